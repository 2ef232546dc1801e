package taskd

import (
	"context"
	"errors"
	"fmt"

	"github.com/faultline-ml/faultline/taskd/lease"
)

// Lead runs one of a job's managers, of which one leads and the others
// wait: it campaigns for l and, each time this manager holds it, builds
// a manager of cfg under the term (cfg.Term), which loads the state in
// StateDir, listens and serves until the term ends; then it campaigns
// again. A standby does not listen, so that members given every
// manager's address (ProxyConfig.Upstream) or a Service reach the
// leader. served, if set, is called with each manager once it listens.
//
// Lead returns nil once ctx ends, having resigned the term it held, so
// that a standby takes over at once; it returns an error when the lease
// refuses this manager (another job's lease, a leader of another
// configuration, a filesystem without working locks) or a manager cannot
// be built (a state in StateDir that it cannot take over, an address in
// use).
func Lead(ctx context.Context, l lease.Lease, cfg ManagerConfig, served func(*Manager)) error {
	if cfg.Term != nil {
		return errors.New("taskd: Lead: ManagerConfig.Term is Lead's to set")
	}
	if err := cfg.Validate(); err != nil {
		return err
	}
	log := discardIfNil(cfg.Logger).With("component", "taskd-manager", "job", cfg.Job)
	for {
		log.Info("taskd: campaigning for the lease; standing by")
		term, err := l.Campaign(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("taskd: manager of job %q: %w", cfg.Job, err)
		}
		log.Info("taskd: leading", "token", term.Token())
		err = leadTerm(ctx, term, cfg, served)
		term.Resign()
		switch {
		case ctx.Err() != nil:
			return nil
		case err != nil && !errors.Is(err, lease.ErrLost):
			return err
		}
		log.Warn("taskd: the lease term ended; standing by again", "token", term.Token(), "cause", context.Cause(term.Context()))
	}
}

// leadTerm serves the job under term until it ends or ctx does.
func leadTerm(ctx context.Context, term lease.Term, cfg ManagerConfig, served func(*Manager)) error {
	cfg.Term = term
	m, err := NewManager(cfg)
	if err != nil {
		return err
	}
	defer m.Close()
	if served != nil {
		served(m)
	}
	return m.Run(ctx)
}
