package taskd

import (
	"fmt"

	"github.com/faultline-ml/faultline/taskd/lease"
)

// memberFence is a member's end of fencing: it keeps the newest fencing
// token of the managers' lease terms that the member has seen, and
// refuses a manager, and the commands, of an older term. A manager
// without a lease carries token 0, which is admitted: it fences nothing.
type memberFence struct{ f lease.Fence }

func (m *memberFence) admit(token uint64) error {
	if token == 0 {
		return nil
	}
	if err := m.f.Admit(token); err != nil {
		return fmt.Errorf("taskd: a deposed manager: %w", err)
	}
	return nil
}

func (m *memberFence) newest() uint64 { return m.f.Newest() }
