package lease

import (
	"errors"
	"sync"
	"testing"
)

func TestFence(t *testing.T) {
	var f Fence
	steps := []struct {
		token uint64
		ok    bool
	}{
		{0, false}, // no term carries 0
		{3, true},
		{3, true}, // the same term again
		{2, false},
		{5, true},
		{3, false},
		{5, true},
	}
	for i, s := range steps {
		err := f.Admit(s.token)
		if (err == nil) != s.ok || (err != nil && !errors.Is(err, ErrStale)) {
			t.Errorf("step %d: Admit(%d) = %v, want ok %v", i, s.token, err, s.ok)
		}
	}
	if f.Newest() != 5 {
		t.Errorf("Newest = %d, want 5", f.Newest())
	}
}

// TestFenceConcurrent: whatever the interleaving, a token is refused only
// if a newer one was admitted before it.
func TestFenceConcurrent(t *testing.T) {
	var f Fence
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for i := uint64(1); i <= 1000; i++ {
				tok := i*4 + uint64(g)
				if err := f.Admit(tok); err != nil && f.Newest() <= tok {
					t.Errorf("Admit(%d) refused with newest %d", tok, f.Newest())
					return
				}
			}
		})
	}
	wg.Wait()
	if f.Newest() != 4003 {
		t.Errorf("Newest = %d, want 4003", f.Newest())
	}
}
