package main

import (
	"context"
	"log/slog"
	"sync"

	"github.com/faultline-ml/faultline/taskd"
	"github.com/faultline-ml/faultline/trace"
)

// runner is what a manager and a proxy have in common.
type runner interface {
	Run(ctx context.Context) error
	Close() error
}

// service runs a manager or a proxy in the background of the process that
// loaded the library.
type service struct {
	name string
	r    runner
	addr string
	log  *slog.Logger

	mu      sync.Mutex
	started bool
	closed  bool
	done    chan struct{}
}

func newService(name string, r runner, addr string, log *slog.Logger) *service {
	return &service{name: name, r: r, addr: addr, log: log, done: make(chan struct{})}
}

func (s *service) start() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.closed:
		return errClosed
	case s.started:
		return errStarted
	}
	s.started = true
	go func() {
		defer close(s.done)
		if err := s.r.Run(context.Background()); err != nil {
			s.log.Error(s.name+" stopped", "err", err)
		}
	}()
	return nil
}

// close stops the service and waits for it. It is idempotent.
func (s *service) close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	started := s.started
	s.mu.Unlock()
	err := s.r.Close()
	if started {
		<-s.done
	}
	return err
}

// manager is a job's manager run from the library.
type manager struct {
	*service
	m *taskd.Manager
}

func newManager(set managerSettings) (*manager, error) {
	log := newLogger(set.LogLevel, "libtaskd-manager")
	cfg := set.Config
	cfg.Logger = log
	if set.SwitchFile != "" {
		cfg.SwitchSource = taskd.SwitchFile(trace.SwitchWatcherConfig{Path: set.SwitchFile, Logger: log})
	}
	m, err := taskd.NewManager(cfg)
	if err != nil {
		return nil, err
	}
	return &manager{service: newService("manager", m, m.Addr().String(), log), m: m}, nil
}

// proxy is a node's proxy run from the library.
type proxy struct {
	*service
}

func newProxy(set proxySettings) (*proxy, error) {
	log := newLogger(set.LogLevel, "libtaskd-proxy")
	cfg := set.Config
	cfg.Logger = log
	p, err := taskd.NewProxy(cfg)
	if err != nil {
		return nil, err
	}
	return &proxy{service: newService("proxy", p, p.Addr().String(), log)}, nil
}
