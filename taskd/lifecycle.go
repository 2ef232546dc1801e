package taskd

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"

	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"
)

// lifecycle is the New, Run, Close protocol that Manager, Proxy and
// Worker share: Run may be called once, and not after Close; Close stops
// Run, waits for it, releases what Run would have released had it never
// run, and is idempotent. Call init before use.
type lifecycle struct {
	state     atomic.Int32  // 0 new, 1 running, 2 closed
	closed    chan struct{} // closed by Close
	closeOnce sync.Once
	runDone   chan struct{} // closed when Run returns, or by Close when Run never ran
}

func (l *lifecycle) init() {
	l.closed = make(chan struct{})
	l.runDone = make(chan struct{})
}

// begin marks Run as running, refusing a second Run or one after Close;
// role names the type in the error. Run then defers l.end.
func (l *lifecycle) begin(role string) error {
	if !l.state.CompareAndSwap(0, 1) {
		return fmt.Errorf("taskd: %s.Run called twice or after Close", role)
	}
	return nil
}

// end marks Run as returned.
func (l *lifecycle) end() { close(l.runDone) }

// close stops Run and waits for it to return; when Run never ran it calls
// neverRan instead, to release what Run would have. Then, once, it calls
// release.
func (l *lifecycle) close(neverRan, release func()) {
	l.closeOnce.Do(func() {
		close(l.closed)
		if l.state.CompareAndSwap(0, 2) {
			neverRan()
			close(l.runDone)
		}
		<-l.runDone
		release()
	})
	<-l.runDone
}

// serveGRPC runs srv on lis in g until ctx ends or Close is called; then it
// stops srv and calls cancel, which ends g's other goroutines. role names
// the server in an error.
func (l *lifecycle) serveGRPC(ctx context.Context, g *errgroup.Group, cancel context.CancelFunc, srv *grpc.Server, lis net.Listener, role string) {
	g.Go(func() error {
		if err := srv.Serve(lis); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
			return fmt.Errorf("taskd: %s serve: %w", role, err)
		}
		return nil
	})
	g.Go(func() error {
		select {
		case <-ctx.Done():
		case <-l.closed:
		}
		srv.Stop()
		cancel()
		return nil
	})
}
