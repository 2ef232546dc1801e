package lease

import (
	"fmt"
	"sync"
)

// Fence is the receiving end of fencing. Whatever a manager commands (a
// worker, an executor, a store) keeps one, and each command carries its
// term's token: Admit lets through the newest term's acts and refuses
// those of any older term, so that a deposed manager that has not yet
// learnt of it can do no harm. The zero value admits any token; a Fence
// is safe for concurrent use.
type Fence struct {
	mu     sync.Mutex
	newest uint64
}

// Admit returns nil if token is no older than the newest token admitted
// so far, and makes it the newest. It refuses an older token, and the
// token 0 that no term carries, with an error wrapping ErrStale.
func (f *Fence) Admit(token uint64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	switch {
	case token == 0:
		return fmt.Errorf("%w: the act carries no token (0)", ErrStale)
	case token < f.newest:
		return fmt.Errorf("%w: token %d is older than %d, the newest term's: the act comes from a deposed holder", ErrStale, token, f.newest)
	}
	f.newest = token
	return nil
}

// Newest returns the newest token admitted, 0 before the first.
func (f *Fence) Newest() uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.newest
}
