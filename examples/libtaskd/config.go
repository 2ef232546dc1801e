package main

import (
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/faultline-ml/faultline/taskd"
	"github.com/faultline-ml/faultline/trace"
)

// Environment variables read when a configuration leaves a field out.
const (
	envTaskID        = trace.EnvTaskID       // job id, as MindCluster
	envRunID         = "TORCHELASTIC_RUN_ID" // torchrun's job id, the same on every node
	envNodeRank      = "NODE_RANK"           // node rank (torchrun sets GROUP_RANK too)
	envGroupRank     = "GROUP_RANK"
	envLocalRank     = "LOCAL_RANK"
	envMasterAddr    = "MASTER_ADDR"
	envUpstream      = "TASKD_UPSTREAM"       // a worker's proxy or manager
	envManagerAddr   = "TASKD_MANAGER_ADDR"   // a proxy's manager
	envTLSDir        = "TASKD_TLS_DIR"        // ca.crt, tls.crt, tls.key
	envToken         = "TASKD_TOKEN"          // shared token
	envInsecure      = "TASKD_INSECURE"       // "1" or "true" allows plaintext
	envAdminToken    = "TASKD_ADMIN_TOKEN"    // the operators' token
	envProxyToken    = "TASKD_PROXY_TOKEN"    // the proxies' token
	envProfilingRoot = "TASKD_PROFILING_ROOT" // dotting root
	envMarkerLibrary = "TASKD_MARKER_LIBRARY" // mspti library path or name, "off"
	envLogLevel      = "TASKD_LOG_LEVEL"      // debug, info, warn, error
)

// Defaults of the C ABI's configurations.
const (
	defaultDiskLimitMB = 5000
	defaultFramework   = "pt"
	defaultManagerPort = "9601"
	markerLibraryOff   = "off"
)

// Ager modes of a worker.
const (
	agerAuto = "auto" // run on the node's local rank 0
	agerOn   = "on"
	agerOff  = "off"
)

var frameworkRE = regexp.MustCompile(`^[a-z][a-z0-9_-]{0,31}$`)

// configError names the configuration and field that are wrong.
type configError struct {
	Config string // "worker", "manager", "proxy"
	Field  string
	Msg    string
}

func (e *configError) Error() string {
	if e.Field == "" {
		return e.Config + " config: " + e.Msg
	}
	return fmt.Sprintf("%s config: field %q: %s", e.Config, e.Field, e.Msg)
}

// decodeStrict decodes a JSON object into v, refusing unknown fields,
// values of the wrong type and anything after the object; each error names
// its field. Fields are decoded one at a time, in name order, so that an
// error from a value's own decoding (a duration, a switch) names its field
// too. An empty or all-blank document leaves v as it is.
func decodeStrict(config string, doc []byte, v any) error {
	if len(bytes.TrimSpace(doc)) == 0 {
		return nil
	}
	var fields map[string]json.RawMessage
	dec := json.NewDecoder(bytes.NewReader(doc))
	if err := dec.Decode(&fields); err != nil || fields == nil {
		msg := "not a JSON object"
		if err != nil {
			msg += ": " + err.Error()
		}
		return &configError{Config: config, Msg: msg}
	}
	if _, err := dec.Token(); err != io.EOF {
		return &configError{Config: config, Msg: "data after the JSON object"}
	}
	for _, name := range slices.Sorted(maps.Keys(fields)) {
		one, err := json.Marshal(map[string]json.RawMessage{name: fields[name]})
		if err != nil {
			return &configError{Config: config, Field: name, Msg: err.Error()}
		}
		d := json.NewDecoder(bytes.NewReader(one))
		d.DisallowUnknownFields()
		if err := d.Decode(v); err != nil {
			var te *json.UnmarshalTypeError
			switch {
			case errors.As(err, &te):
				return &configError{Config: config, Field: name, Msg: fmt.Sprintf("a JSON %s is not a %s", te.Value, te.Type)}
			case strings.HasPrefix(err.Error(), "json: unknown field "):
				return &configError{Config: config, Field: name, Msg: "unknown field"}
			}
			return &configError{Config: config, Field: name, Msg: err.Error()}
		}
	}
	return nil
}

// duration is a JSON duration: a Go duration string ("500ms", "2s").
type duration time.Duration

func (d *duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return errors.New(`a duration is a string such as "500ms"`)
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return err
	}
	if v < 0 {
		return fmt.Errorf("negative duration %q", s)
	}
	*d = duration(v)
	return nil
}

// securityOptions are the fields every role shares to authenticate.
type securityOptions struct {
	TLSDir    string `json:"tls_dir"`    // default $TASKD_TLS_DIR
	Token     string `json:"token"`      // default $TASKD_TOKEN
	TokenFile string `json:"token_file"` // read when Token is empty
	Insecure  *bool  `json:"insecure"`   // default $TASKD_INSECURE
}

func (o securityOptions) resolve(config string, getenv func(string) string) (taskd.Security, error) {
	dir := cmp.Or(o.TLSDir, getenv(envTLSDir))
	var sec taskd.Security
	if dir != "" {
		sec = taskd.SecurityFromDir(dir)
	}
	var err error
	if sec.Token, err = secret(config, "token_file", o.Token, o.TokenFile, envToken, getenv); err != nil {
		return sec, err
	}
	if o.Insecure != nil {
		sec.Insecure = *o.Insecure
	} else if v := getenv(envInsecure); v != "" {
		b, err := strconv.ParseBool(v)
		if err != nil {
			return sec, &configError{Config: config, Field: "insecure", Msg: fmt.Sprintf("$%s=%q is not a boolean", envInsecure, v)}
		}
		sec.Insecure = b
	}
	if err := sec.Validate(); err != nil {
		return sec, &configError{Config: config, Field: "tls_dir", Msg: fmt.Sprintf(
			"no way to reach the control plane safely: give option tls_dir or $%s (mutual TLS), option token, token_file or $%s (a shared token, with insecure for plaintext), or option insecure or $%s=1 (plaintext, for a trusted network): %v",
			envTLSDir, envToken, envInsecure, err)}
	}
	return sec, nil
}

// secret returns a token given by value, else read from file (option
// field), else from the environment variable env.
func secret(config, field, value, file, env string, getenv func(string) string) (string, error) {
	if value == "" && file != "" {
		b, err := os.ReadFile(file)
		if err != nil {
			return "", &configError{Config: config, Field: field, Msg: err.Error()}
		}
		if value = strings.TrimSpace(string(b)); value == "" {
			return "", &configError{Config: config, Field: field, Msg: file + " holds no token (an unfilled secret?)"}
		}
	}
	return cmp.Or(value, getenv(env)), nil
}

// named reports whether any credential is given, by option or
// environment.
func (o securityOptions) named(getenv func(string) string) bool {
	return o.TLSDir != "" || o.Token != "" || o.TokenFile != "" || o.Insecure != nil ||
		getenv(envTLSDir) != "" || getenv(envToken) != "" || getenv(envInsecure) != ""
}

// envInt reads the first of names that is set as an int.
func envInt(config, field string, getenv func(string) string, names ...string) (int, bool, error) {
	for _, n := range names {
		if v := getenv(n); v != "" {
			i, err := strconv.Atoi(v)
			if err != nil || i < 0 {
				return 0, false, &configError{Config: config, Field: field, Msg: fmt.Sprintf("$%s=%q is not a non-negative integer", n, v)}
			}
			return i, true, nil
		}
	}
	return 0, false, nil
}

func logLevel(config, s string, getenv func(string) string) (slog.Level, error) {
	s = cmp.Or(s, getenv(envLogLevel))
	if s == "" {
		return slog.LevelWarn, nil
	}
	var l slog.Level
	if err := l.UnmarshalText([]byte(s)); err != nil {
		return 0, &configError{Config: config, Field: "log_level", Msg: fmt.Sprintf("%q is not debug, info, warn or error", s)}
	}
	return l, nil
}

// workerOptions is the JSON a C caller may add to taskd_init_worker; every
// field may be left out.
type workerOptions struct {
	Job       string `json:"job"`        // default $MINDX_TASK_ID, $TORCHELASTIC_RUN_ID, else claimed per launcher
	Node      *int   `json:"node"`       // default $NODE_RANK, $GROUP_RANK, 0
	LocalRank *int   `json:"local_rank"` // default $LOCAL_RANK, else the rank
	Device    *int   `json:"device"`     // device id in records; default the local rank
	Upstream  string `json:"upstream"`   // default $TASKD_UPSTREAM, 127.0.0.1:9602 when a credential is given; else none
	securityOptions
	Root          string   `json:"root"`           // default $TASKD_PROFILING_ROOT, /user/cluster-info/profiling
	Ager          string   `json:"ager"`           // auto (local rank 0), on, off
	MarkerLibrary string   `json:"marker_library"` // default $TASKD_MARKER_LIBRARY, libmspti.so; "off"
	FlushInterval duration `json:"flush_interval"` // default 5 s
	// Switch is the profiling switch until the manager sends one (a
	// profilingSwitch document); default all off.
	Switch   *trace.Switch `json:"switch"`
	LogLevel string        `json:"log_level"` // default $TASKD_LOG_LEVEL, warn
}

// workerSettings is a worker's resolved configuration.
type workerSettings struct {
	Job                   string
	Node, Rank, LocalRank int
	Device                uint32
	Upstream              string
	Security              taskd.Security
	Root                  string
	BudgetBytes           int64
	Framework             string
	RunAger               bool
	MarkerLibrary         string // "" when off
	FlushInterval         time.Duration
	Switch                trace.Switch
	LogLevel              slog.Level
}

// resolveWorker combines the arguments of taskd_init_worker, its JSON
// options and the environment.
func resolveWorker(rank, diskLimitMB int, framework string, options []byte, getenv func(string) string) (workerSettings, error) {
	const cfgName = "worker"
	var o workerOptions
	if err := decodeStrict(cfgName, options, &o); err != nil {
		return workerSettings{}, err
	}
	s := workerSettings{Rank: rank, Job: o.Job, Upstream: o.Upstream, Root: o.Root, Framework: framework,
		FlushInterval: time.Duration(o.FlushInterval)}
	if o.Switch != nil {
		s.Switch = *o.Switch
	}
	if rank < 0 {
		return s, &configError{Config: cfgName, Field: "rank_id", Msg: fmt.Sprintf("%d is negative", rank)}
	}
	if diskLimitMB <= 0 {
		return s, &configError{Config: cfgName, Field: "upper_limit_of_disk_in_mb", Msg: fmt.Sprintf("%d is not positive", diskLimitMB)}
	}
	s.BudgetBytes = int64(diskLimitMB) << 20
	s.Framework = cmp.Or(s.Framework, defaultFramework)
	if !frameworkRE.MatchString(s.Framework) {
		return s, &configError{Config: cfgName, Field: "framework", Msg: fmt.Sprintf("%q is not a framework name such as \"pt\" or \"ms\"", s.Framework)}
	}
	s.Root = cmp.Or(s.Root, getenv(envProfilingRoot), trace.DefaultRoot)
	// The job: named, else the launcher's (torchrun's run id is the same on
	// every node), else one claimed once per launcher on this node.
	from := "option job"
	for _, v := range []string{envTaskID, envRunID} {
		if s.Job == "" {
			s.Job, from = getenv(v), "$"+v
		}
	}
	if s.Job == "" {
		job, err := resolveJob(s.Root)
		if err != nil {
			return s, &configError{Config: cfgName, Field: "job", Msg: fmt.Sprintf("empty, $%s and $%s are not set, and no job could be claimed under %s: %v", envTaskID, envRunID, s.Root, err)}
		}
		s.Job, from = job, "a job claimed under "+s.Root
	}
	if err := trace.ValidateJob(s.Job); err != nil {
		return s, &configError{Config: cfgName, Field: "job", Msg: fmt.Sprintf("%s: %v", from, err)}
	}
	if o.Node != nil {
		s.Node = *o.Node
	} else if n, _, err := envInt(cfgName, "node", getenv, envNodeRank, envGroupRank); err != nil {
		return s, err
	} else {
		s.Node = n
	}
	if s.Node < 0 {
		return s, &configError{Config: cfgName, Field: "node", Msg: fmt.Sprintf("%d is negative", s.Node)}
	}
	s.LocalRank = rank
	if o.LocalRank != nil {
		s.LocalRank = *o.LocalRank
	} else if n, ok, err := envInt(cfgName, "local_rank", getenv, envLocalRank); err != nil {
		return s, err
	} else if ok {
		s.LocalRank = n
	}
	if s.LocalRank < 0 {
		return s, &configError{Config: cfgName, Field: "local_rank", Msg: fmt.Sprintf("%d is negative", s.LocalRank)}
	}
	dev := s.LocalRank
	if o.Device != nil {
		dev = *o.Device
	}
	if dev < 0 || int64(dev) > int64(^uint32(0)) {
		return s, &configError{Config: cfgName, Field: "device", Msg: fmt.Sprintf("%d is out of range", dev)}
	}
	s.Device = uint32(dev)
	s.Upstream = cmp.Or(s.Upstream, getenv(envUpstream))
	// With no control plane named at all (no upstream, no credential: a
	// job under plain torchrun), the worker dots into files and connects
	// nowhere; naming either asks for the control plane, and then both
	// must be right.
	if s.Upstream != "" || o.securityOptions.named(getenv) {
		s.Upstream = cmp.Or(s.Upstream, taskd.DefaultProxyAddr)
		if _, _, err := net.SplitHostPort(s.Upstream); err != nil {
			return s, &configError{Config: cfgName, Field: "upstream", Msg: err.Error()}
		}
		sec, err := o.securityOptions.resolve(cfgName, getenv)
		if err != nil {
			return s, err
		}
		s.Security = sec
	}
	switch o.Ager {
	case "", agerAuto:
		s.RunAger = s.LocalRank == 0
	case agerOn:
		s.RunAger = true
	case agerOff:
	default:
		return s, &configError{Config: cfgName, Field: "ager", Msg: fmt.Sprintf("%q is not auto, on or off", o.Ager)}
	}
	s.MarkerLibrary = cmp.Or(o.MarkerLibrary, getenv(envMarkerLibrary))
	if s.MarkerLibrary == markerLibraryOff {
		s.MarkerLibrary = ""
	} else if s.MarkerLibrary == "" {
		s.MarkerLibrary = defaultMarkerLibrary
	}
	var err error
	if s.LogLevel, err = logLevel(cfgName, o.LogLevel, getenv); err != nil {
		return s, err
	}
	return s, nil
}

// resolveJob claims the job folder of this process's launcher on this
// node (trace.ResolveJob); a variable, so that tests use their own.
var resolveJob = trace.ResolveJob

// managerOptions is the JSON of taskd_init_manager. MindCluster's keys
// (job_id, node_nums, proc_per_node) are accepted beside ours.
type managerOptions struct {
	Job          string `json:"job"`
	JobID        string `json:"job_id"`
	Listen       string `json:"listen"` // default ":9601"
	Nodes        int    `json:"nodes"`
	NodeNums     int    `json:"node_nums"`
	ProcsPerNode int    `json:"procs_per_node"`
	ProcPerNode  int    `json:"proc_per_node"`
	securityOptions
	AdminToken        string   `json:"admin_token"`      // default $TASKD_ADMIN_TOKEN
	AdminTokenFile    string   `json:"admin_token_file"` // read when AdminToken is empty
	ProxyToken        string   `json:"proxy_token"`      // default $TASKD_PROXY_TOKEN
	ProxyTokenFile    string   `json:"proxy_token_file"` // read when ProxyToken is empty
	StateDir          string   `json:"state_dir"`
	CollectDir        string   `json:"collect_dir"`
	SwitchFile        string   `json:"switch_file"`
	HeartbeatInterval duration `json:"heartbeat_interval"`
	HeartbeatDeadline duration `json:"heartbeat_deadline"`
	LogLevel          string   `json:"log_level"`
}

// managerSettings is a manager's resolved configuration.
type managerSettings struct {
	Config     taskd.ManagerConfig
	SwitchFile string
	LogLevel   slog.Level
}

// pick returns the one value two aliases give, or an error when they differ.
func pick[T comparable](config, a, b string, va, vb T) (T, error) {
	var zero T
	if va != zero && vb != zero && va != vb {
		return zero, &configError{Config: config, Field: b, Msg: fmt.Sprintf("%v contradicts %s %v", vb, a, va)}
	}
	if va != zero {
		return va, nil
	}
	return vb, nil
}

func resolveManager(doc []byte, getenv func(string) string) (managerSettings, error) {
	const cfgName = "manager"
	var o managerOptions
	if err := decodeStrict(cfgName, doc, &o); err != nil {
		return managerSettings{}, err
	}
	var s managerSettings
	var err error
	c := &s.Config
	if c.Job, err = pick(cfgName, "job", "job_id", o.Job, o.JobID); err != nil {
		return s, err
	}
	c.Job = cmp.Or(c.Job, getenv(envTaskID))
	if c.Job == "" {
		return s, &configError{Config: cfgName, Field: "job_id", Msg: "empty, and $" + envTaskID + " is not set"}
	}
	if c.Nodes, err = pick(cfgName, "nodes", "node_nums", o.Nodes, o.NodeNums); err != nil {
		return s, err
	}
	if c.ProcsPerNode, err = pick(cfgName, "procs_per_node", "proc_per_node", o.ProcsPerNode, o.ProcPerNode); err != nil {
		return s, err
	}
	c.Listen = o.Listen
	c.StateDir, c.CollectDir = o.StateDir, o.CollectDir
	c.HeartbeatInterval, c.HeartbeatDeadline = time.Duration(o.HeartbeatInterval), time.Duration(o.HeartbeatDeadline)
	if c.Security, err = o.securityOptions.resolve(cfgName, getenv); err != nil {
		return s, err
	}
	if c.AdminToken, err = secret(cfgName, "admin_token_file", o.AdminToken, o.AdminTokenFile, envAdminToken, getenv); err != nil {
		return s, err
	}
	if c.ProxyToken, err = secret(cfgName, "proxy_token_file", o.ProxyToken, o.ProxyTokenFile, envProxyToken, getenv); err != nil {
		return s, err
	}
	s.SwitchFile = o.SwitchFile
	if s.LogLevel, err = logLevel(cfgName, o.LogLevel, getenv); err != nil {
		return s, err
	}
	if err := c.Validate(); err != nil {
		return s, &configError{Config: cfgName, Msg: err.Error()}
	}
	return s, nil
}

// proxyOptions is the JSON of taskd_init_proxy.
type proxyOptions struct {
	Job      string `json:"job"`
	JobID    string `json:"job_id"`
	Node     *int   `json:"node"`     // default $NODE_RANK, $GROUP_RANK, 0
	Upstream string `json:"upstream"` // default $TASKD_MANAGER_ADDR, $MASTER_ADDR:9601
	Listen   string `json:"listen"`   // default 127.0.0.1:9602
	securityOptions
	UpstreamToken     string `json:"upstream_token"`      // default $TASKD_PROXY_TOKEN
	UpstreamTokenFile string `json:"upstream_token_file"` // read when UpstreamToken is empty
	DottingRoot       string `json:"dotting_root"`        // default $TASKD_PROFILING_ROOT, /user/cluster-info/profiling
	StackRoot         string `json:"stack_root"`
	LogLevel          string `json:"log_level"`
}

// proxySettings is a proxy's resolved configuration.
type proxySettings struct {
	Config   taskd.ProxyConfig
	LogLevel slog.Level
}

func resolveProxy(doc []byte, getenv func(string) string) (proxySettings, error) {
	const cfgName = "proxy"
	var o proxyOptions
	if err := decodeStrict(cfgName, doc, &o); err != nil {
		return proxySettings{}, err
	}
	var s proxySettings
	var err error
	c := &s.Config
	if c.Job, err = pick(cfgName, "job", "job_id", o.Job, o.JobID); err != nil {
		return s, err
	}
	c.Job = cmp.Or(c.Job, getenv(envTaskID))
	if c.Job == "" {
		return s, &configError{Config: cfgName, Field: "job_id", Msg: "empty, and $" + envTaskID + " is not set"}
	}
	if o.Node != nil {
		c.Node = *o.Node
	} else if c.Node, _, err = envInt(cfgName, "node", getenv, envNodeRank, envGroupRank); err != nil {
		return s, err
	}
	c.Upstream = cmp.Or(o.Upstream, getenv(envManagerAddr))
	if c.Upstream == "" {
		if host := getenv(envMasterAddr); host != "" {
			c.Upstream = net.JoinHostPort(host, defaultManagerPort)
		}
	}
	if c.Upstream == "" {
		return s, &configError{Config: cfgName, Field: "upstream", Msg: "empty, and neither $" + envManagerAddr + " nor $" + envMasterAddr + " is set"}
	}
	c.Listen = o.Listen
	c.DottingRoot = cmp.Or(o.DottingRoot, getenv(envProfilingRoot))
	c.StackRoot = o.StackRoot
	if c.Security, err = o.securityOptions.resolve(cfgName, getenv); err != nil {
		return s, err
	}
	if c.UpstreamToken, err = secret(cfgName, "upstream_token_file", o.UpstreamToken, o.UpstreamTokenFile, envProxyToken, getenv); err != nil {
		return s, err
	}
	if s.LogLevel, err = logLevel(cfgName, o.LogLevel, getenv); err != nil {
		return s, err
	}
	if err := c.Validate(); err != nil {
		return s, &configError{Config: cfgName, Msg: err.Error()}
	}
	return s, nil
}
