/*
 * A fake libdcmi (Ascend DCMI) for the npu tests: the functions npu calls,
 * with the real names, types, structures and return codes
 * (dcmi_interface_api.h), answering from a small table that fake_control
 * edits. Card ids are sparse on purpose, as on real hosts.
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define DCMI_OK 0
#define DCMI_ERR_CODE_INVALID_PARAMETER (-8001)
#define DCMI_ERR_CODE_INNER_ERR (-8005)
#define DCMI_ERR_CODE_DEVICE_NOT_EXIST (-8008)
#define DCMI_ERR_CODE_NOT_SUPPORT (-8255)

#define DCMI_MAIN_CMD_HCCS 16
#define DCMI_HCCS_CMD_GET_LANE_INFO 1
#define DCMI_HCCS_CMD_GET_STATISTIC_INFO_U64 5
#define DCMI_HCCS_MAX_PCS_NUM 16
#define DCMI_UTILIZATION_RATE_AICORE 2

struct dcmi_hbm_info {
	unsigned long long memory_size; /* MB */
	unsigned int freq;
	unsigned long long memory_usage; /* MB */
	int temp;
	unsigned int bandwith_util_rate;
};

struct dcmi_get_memory_info_stru {
	unsigned long long memory_size;      /* MB */
	unsigned long long memory_available; /* MB */
	unsigned int freq;
	unsigned long hugepagesize;
	unsigned long hugepages_total;
	unsigned long hugepages_free;
	unsigned int utiliza;
	unsigned char reserve[60];
};

struct dcmi_hccs_lane_info {
	unsigned int hccs_port_pcs_bitmap;
	unsigned int pcs_lane_bitmap[DCMI_HCCS_MAX_PCS_NUM];
	unsigned int reserve[16];
};

struct dcmi_hccs_statistic_info_u64 {
	unsigned long long tx_cnt[DCMI_HCCS_MAX_PCS_NUM];
	unsigned long long rx_cnt[DCMI_HCCS_MAX_PCS_NUM];
	unsigned long long crc_err_cnt[DCMI_HCCS_MAX_PCS_NUM];
	unsigned long long retry_cnt[DCMI_HCCS_MAX_PCS_NUM];
	unsigned long long reserved[64];
};

#define N_CARDS 2
static const int card_ids[N_CARDS] = {4, 6};

struct chip {
	unsigned int util;
	unsigned int health;
	unsigned long long used_mb;
	int missing;
	int lane_down; /* PCS index whose lanes are down, or -1 */
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct chip chips[N_CARDS];
static int no_driver, inited, no_hbm, no_hccs, configured;

static void configure(void) {
	if (configured)
		return;
	configured = 1;
	for (int i = 0; i < N_CARDS; i++) {
		chips[i].util = (unsigned)(40 + i);
		chips[i].used_mb = 1024ull * (unsigned long long)(i + 2);
		chips[i].lane_down = -1;
	}
}

/* chip_of returns the chip for (card, device), or NULL. */
static struct chip *chip_of(int card, int device) {
	if (device != 0)
		return NULL;
	for (int i = 0; i < N_CARDS; i++)
		if (card_ids[i] == card)
			return &chips[i];
	return NULL;
}

static int lookup(int card, int device, struct chip **c) {
	if (!inited)
		return DCMI_ERR_CODE_INNER_ERR;
	*c = chip_of(card, device);
	if (*c == NULL)
		return DCMI_ERR_CODE_INVALID_PARAMETER;
	if ((*c)->missing)
		return DCMI_ERR_CODE_DEVICE_NOT_EXIST;
	return DCMI_OK;
}

int dcmi_init(void) {
	pthread_mutex_lock(&mu);
	configure();
	int rc = no_driver ? DCMI_ERR_CODE_INNER_ERR : DCMI_OK;
	if (rc == DCMI_OK)
		inited = 1;
	pthread_mutex_unlock(&mu);
	return rc;
}

int dcmi_get_card_num_list(int *card_num, int *card_list, int list_len) {
	if (card_num == NULL || card_list == NULL || list_len < N_CARDS)
		return DCMI_ERR_CODE_INVALID_PARAMETER;
	pthread_mutex_lock(&mu);
	int rc = inited ? DCMI_OK : DCMI_ERR_CODE_INNER_ERR;
	if (rc == DCMI_OK) {
		*card_num = N_CARDS;
		for (int i = 0; i < N_CARDS; i++)
			card_list[i] = card_ids[i];
	}
	pthread_mutex_unlock(&mu);
	return rc;
}

int dcmi_get_device_num_in_card(int card_id, int *device_num) {
	pthread_mutex_lock(&mu);
	int rc = chip_of(card_id, 0) ? DCMI_OK : DCMI_ERR_CODE_INVALID_PARAMETER;
	if (rc == DCMI_OK)
		*device_num = 1;
	pthread_mutex_unlock(&mu);
	return rc;
}

int dcmi_get_device_logic_id(int *device_logic_id, int card_id, int device_id) {
	pthread_mutex_lock(&mu);
	int rc = DCMI_ERR_CODE_INVALID_PARAMETER;
	for (int i = 0; i < N_CARDS; i++)
		if (card_ids[i] == card_id && device_id == 0) {
			*device_logic_id = i;
			rc = DCMI_OK;
		}
	pthread_mutex_unlock(&mu);
	return rc;
}

int dcmi_get_device_utilization_rate(int card_id, int device_id, int input_type, unsigned int *rate) {
	struct chip *c;
	pthread_mutex_lock(&mu);
	int rc = lookup(card_id, device_id, &c);
	if (rc == DCMI_OK) {
		if (input_type == DCMI_UTILIZATION_RATE_AICORE)
			*rate = c->util;
		else
			rc = DCMI_ERR_CODE_NOT_SUPPORT;
	}
	pthread_mutex_unlock(&mu);
	return rc;
}

int dcmi_get_device_hbm_info(int card_id, int device_id, struct dcmi_hbm_info *info) {
	struct chip *c;
	pthread_mutex_lock(&mu);
	int rc = lookup(card_id, device_id, &c);
	if (rc == DCMI_OK && no_hbm)
		rc = DCMI_ERR_CODE_NOT_SUPPORT;
	if (rc == DCMI_OK) {
		memset(info, 0, sizeof *info);
		info->memory_size = 65536;
		info->memory_usage = c->used_mb;
	}
	pthread_mutex_unlock(&mu);
	return rc;
}

int dcmi_get_device_memory_info_v3(int card_id, int device_id, struct dcmi_get_memory_info_stru *info) {
	struct chip *c;
	pthread_mutex_lock(&mu);
	int rc = lookup(card_id, device_id, &c);
	if (rc == DCMI_OK) {
		memset(info, 0, sizeof *info);
		info->memory_size = 32768;
		info->memory_available = 32768 - c->used_mb;
	}
	pthread_mutex_unlock(&mu);
	return rc;
}

int dcmi_get_device_health(int card_id, int device_id, unsigned int *health) {
	struct chip *c;
	pthread_mutex_lock(&mu);
	int rc = lookup(card_id, device_id, &c);
	if (rc == DCMI_OK)
		*health = c->health;
	pthread_mutex_unlock(&mu);
	return rc;
}

int dcmi_get_device_info(int card_id, int device_id, int main_cmd, unsigned int sub_cmd, void *buf, unsigned int *size) {
	struct chip *c;
	pthread_mutex_lock(&mu);
	int rc = lookup(card_id, device_id, &c);
	if (rc == DCMI_OK && (main_cmd != DCMI_MAIN_CMD_HCCS || no_hccs))
		rc = DCMI_ERR_CODE_NOT_SUPPORT;
	if (rc == DCMI_OK && sub_cmd == DCMI_HCCS_CMD_GET_LANE_INFO) {
		struct dcmi_hccs_lane_info *l = buf;
		if (size == NULL || *size < sizeof *l) {
			rc = DCMI_ERR_CODE_INVALID_PARAMETER;
		} else {
			memset(l, 0, sizeof *l);
			l->hccs_port_pcs_bitmap = 0xFE; /* PCS 1-7 are HCCS ports */
			for (int i = 1; i <= 7; i++)
				l->pcs_lane_bitmap[i] = i == c->lane_down ? 0 : 0xF;
			*size = sizeof *l;
		}
	} else if (rc == DCMI_OK && sub_cmd == DCMI_HCCS_CMD_GET_STATISTIC_INFO_U64) {
		struct dcmi_hccs_statistic_info_u64 *s = buf;
		if (size == NULL || *size < sizeof *s) {
			rc = DCMI_ERR_CODE_INVALID_PARAMETER;
		} else {
			memset(s, 0, sizeof *s);
			for (int i = 0; i < DCMI_HCCS_MAX_PCS_NUM; i++) {
				s->tx_cnt[i] = 100ull * (unsigned long long)i;
				s->rx_cnt[i] = 200ull * (unsigned long long)i;
				s->crc_err_cnt[i] = (unsigned long long)(i == c->lane_down);
				s->retry_cnt[i] = 0;
			}
			*size = sizeof *s;
		}
	} else if (rc == DCMI_OK) {
		rc = DCMI_ERR_CODE_NOT_SUPPORT;
	}
	pthread_mutex_unlock(&mu);
	return rc;
}

/* ---- test control ----
 * no_driver a=1|0   dcmi_init fails
 * no_hbm a=1|0      dcmi_get_device_hbm_info is not supported
 * no_hccs a=1|0     HCCS queries are not supported
 * health a=chip b=value
 * missing a=chip    the chip answers DCMI_ERR_CODE_DEVICE_NOT_EXIST
 * lane_down a=chip b=pcs
 * util a=chip b=percent
 */
int64_t fake_control(const char *op, int64_t a, int64_t b, int64_t c, const char *s1, const char *s2) {
	(void)c;
	(void)s1;
	(void)s2;
	int64_t v = 0;
	pthread_mutex_lock(&mu);
	configure();
	int i = (a >= 0 && a < N_CARDS) ? (int)a : 0;
	if (strcmp(op, "no_driver") == 0)
		no_driver = (int)a;
	else if (strcmp(op, "no_hbm") == 0)
		no_hbm = (int)a;
	else if (strcmp(op, "no_hccs") == 0)
		no_hccs = (int)a;
	else if (strcmp(op, "health") == 0)
		chips[i].health = (unsigned)b;
	else if (strcmp(op, "missing") == 0)
		chips[i].missing = 1;
	else if (strcmp(op, "lane_down") == 0)
		chips[i].lane_down = (int)b;
	else if (strcmp(op, "util") == 0)
		chips[i].util = (unsigned)b;
	else
		v = -1;
	pthread_mutex_unlock(&mu);
	return v;
}
