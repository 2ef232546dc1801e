package taskd

const childRoleEnv = "TASKD_TEST_CHILD"

func runChild(role string) int { return 2 }
