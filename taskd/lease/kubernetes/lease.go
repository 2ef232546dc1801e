package kubernetes

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/go-logr/logr"
	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/leaderelection"
	rl "k8s.io/client-go/tools/leaderelection/resourcelock"

	"github.com/faultline-ml/faultline/taskd/lease"
)

// Defaults of Config's timing: those of Kubernetes' own controllers.
const (
	DefaultLeaseDuration = 15 * time.Second
	DefaultRenewDeadline = 10 * time.Second
	DefaultRetryPeriod   = 2 * time.Second
)

// JobLabel, on a Lease, names the job whose managers campaign for it (the
// job itself if it is a valid label value, else "sha-" and a hash of it).
const JobLabel = "faultline.io/job"

// Config configures a Lease. Client, Name and the Candidate's Job and
// Config are required; every other field's zero value is a documented
// default.
type Config struct {
	Client kubernetes.Interface
	// Namespace and Name name the Lease; Namespace defaults to "default".
	// Give each job its own Lease.
	Namespace string
	Name      string
	// Candidate is who campaigns. Its Name defaults to lease.DefaultName
	// (in a pod, the pod's name and the process id).
	Candidate lease.Candidate
	// LeaseDuration is how long a candidate waits, after it last saw the
	// holder renew, before it takes the Lease; RenewDeadline is how long
	// the holder keeps trying to renew before its term ends; RetryPeriod is
	// how often each tries. LeaseDuration > RenewDeadline > 1.2 ×
	// RetryPeriod; defaults DefaultLeaseDuration, DefaultRenewDeadline and
	// DefaultRetryPeriod. The holder's term ends RenewDeadline after the
	// start of its last successful renewal, before anyone else may take
	// the Lease: LeaseDuration - RenewDeadline is the margin for the
	// clocks' rates.
	LeaseDuration, RenewDeadline, RetryPeriod time.Duration
	// Logger receives a record per term taken and lost, and client-go's
	// leader election's own; nil: discard.
	Logger *slog.Logger
}

// Validate reports the first field of c that is missing or out of range.
func (c Config) Validate() error {
	switch {
	case c.Client == nil:
		return errors.New("lease/kubernetes: Config.Client is nil")
	case len(validation.IsDNS1123Subdomain(c.Name)) > 0:
		return fmt.Errorf("lease/kubernetes: Config.Name %q: %s", c.Name, strings.Join(validation.IsDNS1123Subdomain(c.Name), "; "))
	case c.Namespace != "" && len(validation.IsDNS1123Label(c.Namespace)) > 0:
		return fmt.Errorf("lease/kubernetes: Config.Namespace %q: %s", c.Namespace, strings.Join(validation.IsDNS1123Label(c.Namespace), "; "))
	case c.LeaseDuration < 0 || c.RenewDeadline < 0 || c.RetryPeriod < 0:
		return fmt.Errorf("lease/kubernetes: Config.LeaseDuration %v, RenewDeadline %v, RetryPeriod %v: want >= 0", c.LeaseDuration, c.RenewDeadline, c.RetryPeriod)
	}
	d := c.withDefaults()
	if d.LeaseDuration <= d.RenewDeadline || float64(d.RenewDeadline) <= leaderelection.JitterFactor*float64(d.RetryPeriod) {
		return fmt.Errorf("lease/kubernetes: Config.LeaseDuration %v, RenewDeadline %v, RetryPeriod %v: want LeaseDuration > RenewDeadline > %v × RetryPeriod",
			d.LeaseDuration, d.RenewDeadline, d.RetryPeriod, leaderelection.JitterFactor)
	}
	return c.Candidate.Validate()
}

func (c Config) withDefaults() Config {
	if c.Namespace == "" {
		c.Namespace = "default"
	}
	if c.LeaseDuration == 0 {
		c.LeaseDuration = DefaultLeaseDuration
	}
	if c.RenewDeadline == 0 {
		c.RenewDeadline = DefaultRenewDeadline
	}
	if c.RetryPeriod == 0 {
		c.RetryPeriod = DefaultRetryPeriod
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c
}

// Lease is a lease.Lease kept in a coordination.k8s.io Lease through
// client-go's leader election (resourcelock.LeaseLock).
//
// A term's fencing token is the Lease's spec.leaseTransitions, plus one,
// as it stood once the term took the Lease: every campaign has a holder
// identity of its own, so every term adds a transition. Deleting the Lease
// restarts its transitions, below the tokens that fences have seen: give
// managers no right to delete it, as the example's Role does.
//
// The holder identity also names the job and its configuration hash
// ("NAME/TERM config=CONFIG job=JOB"): a Lease that a holder of another
// job or something that is not a manager holds, or that JobLabel gives to
// another job, is refused (lease.ErrForeign) and left alone; a holder of
// another configuration is refused (*lease.ConfigError) once a candidate
// has seen it renew, so that one that died is taken over in time.
type Lease struct {
	cfg  Config
	desc string // namespace/name
	log  *slog.Logger
}

// New returns the Lease that cfg describes. It makes no API call.
func New(cfg Config) (*Lease, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	if cfg.Candidate.Name == "" {
		cfg.Candidate.Name = lease.DefaultName()
	}
	desc := cfg.Namespace + "/" + cfg.Name
	return &Lease{cfg: cfg, desc: desc, log: cfg.Logger.With("lease", desc, "candidate", cfg.Candidate.Name)}, nil
}

// identity is a term's holder identity in the Lease.
type identity struct{ name, term, config, job string }

func (id identity) String() string {
	return id.name + "/" + id.term + " config=" + id.config + " job=" + id.job
}

// parseIdentity reads a holder identity that a Lease of this package
// wrote; false for any other.
func parseIdentity(s string) (identity, bool) {
	head, rest, ok1 := strings.Cut(s, " config=")
	config, job, ok2 := strings.Cut(rest, " job=")
	name, term, ok3 := strings.Cut(head, "/")
	if !ok1 || !ok2 || !ok3 || name == "" || term == "" || config == "" || job == "" {
		return identity{}, false
	}
	return identity{name: name, term: term, config: config, job: job}, true
}

// jobLabel is JobLabel's value for job.
func jobLabel(job string) string {
	if len(validation.IsValidLabelValue(job)) == 0 {
		return job
	}
	return "sha-" + lease.ConfigHash([]byte(job))
}

// Campaign blocks until this candidate holds the Lease, creating it if
// need be, and returns its term; see lease.Lease. While the API server
// cannot be reached or fails (a restart, a 503, a timeout), it tries
// again until ctx ends.
func (l *Lease) Campaign(ctx context.Context) (lease.Term, error) {
	if err := l.precheck(ctx); err != nil {
		return nil, err
	}
	c := l.cfg.Candidate
	id := identity{name: c.Name, term: randomHex(8), config: c.Config, job: c.Job}
	run, stop := context.WithCancelCause(ctx)
	k := &lock{
		LeaseLock: &rl.LeaseLock{
			LeaseMeta:  metav1.ObjectMeta{Namespace: l.cfg.Namespace, Name: l.cfg.Name},
			Client:     l.cfg.Client.CoordinationV1(),
			LockConfig: rl.ResourceLockConfig{Identity: id.String()},
			Labels:     map[string]string{JobLabel: jobLabel(c.Job)},
		},
		l: l, id: id, refuse: stop, renewed: make(chan struct{}, 1),
	}
	started := make(chan context.Context, 1)
	le, err := leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
		// Resign releases the Lease, once the holder has stopped: a term
		// that ends otherwise (its context, RenewDeadline) stops renewing
		// and leaves the Lease to run out.
		Lock: k, Name: l.desc,
		LeaseDuration: l.cfg.LeaseDuration, RenewDeadline: l.cfg.RenewDeadline, RetryPeriod: l.cfg.RetryPeriod,
		Callbacks: leaderelection.LeaderCallbacks{
			OnStartedLeading: func(lead context.Context) { started <- lead },
			OnStoppedLeading: func() {},
		},
	})
	if err != nil {
		stop(nil)
		return nil, fmt.Errorf("lease/kubernetes: Lease %s: %w", l.desc, err)
	}
	elected := make(chan struct{})
	go func() {
		defer close(elected)
		le.Run(logr.NewContext(run, logr.FromSlogHandler(l.log.Handler())))
	}()
	select {
	case lead := <-started:
		return l.start(ctx, k, run, lead, stop, elected), nil
	case <-elected:
		err := context.Cause(run)
		if errors.Is(err, lease.ErrForeign) || errors.Is(err, lease.ErrConfig) {
			return nil, err
		}
		return nil, fmt.Errorf("lease/kubernetes: Lease %s: campaign: %w", l.desc, err)
	}
}

// precheck refuses a Lease that belongs to another job, before the
// election could take one that nobody holds. It tries again, with
// backoff, until ctx ends while the Lease cannot be read (the API server
// away or slow), as the election itself does.
func (l *Lease) precheck(ctx context.Context) error {
	bo := backoff.NewExponentialBackOff(backoff.WithInitialInterval(l.cfg.RetryPeriod),
		backoff.WithMaxInterval(l.cfg.LeaseDuration), backoff.WithMaxElapsedTime(0))
	for {
		got, err := l.cfg.Client.CoordinationV1().Leases(l.cfg.Namespace).Get(ctx, l.cfg.Name, metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err):
			return nil
		case err == nil:
			return l.judgeLease(got)
		case ctx.Err() != nil:
			return fmt.Errorf("lease/kubernetes: Lease %s: campaign: %w", l.desc, context.Cause(ctx))
		}
		wait := bo.NextBackOff()
		l.log.Warn("lease: cannot get the Lease; trying again", "err", err, "retry_in", wait)
		select {
		case <-ctx.Done():
			return fmt.Errorf("lease/kubernetes: Lease %s: campaign: %w", l.desc, context.Cause(ctx))
		case <-time.After(wait):
		}
	}
}

// judgeLease refuses got if it is labelled for another job or held by
// something that is not a manager of this job.
func (l *Lease) judgeLease(got *coordinationv1.Lease) error {
	if v, ok := got.Labels[JobLabel]; ok && v != jobLabel(l.cfg.Candidate.Job) {
		return fmt.Errorf("%w: Lease %s is labelled %s=%s, not job %q's: refused, nothing changed; give each job its own Lease",
			lease.ErrForeign, l.desc, JobLabel, v, l.cfg.Candidate.Job)
	}
	if h := got.Spec.HolderIdentity; h != nil && *h != "" {
		return l.foreignHolder(*h)
	}
	return nil
}

// foreignHolder returns an error if holder is not a manager of this job.
func (l *Lease) foreignHolder(holder string) error {
	id, ok := parseIdentity(holder)
	if ok && id.job == l.cfg.Candidate.Job {
		return nil
	}
	return fmt.Errorf("%w: Lease %s is held by %q, not by a manager of job %q: refused, nothing changed; give each job its own Lease",
		lease.ErrForeign, l.desc, holder, l.cfg.Candidate.Job)
}

// lock is the election's resource lock: client-go's LeaseLock, watched so
// that the campaign learns its term's token and the times it renewed, and
// refuses another job's holder or a live one of another configuration.
type lock struct {
	*rl.LeaseLock
	l       *Lease
	id      identity
	refuse  context.CancelCauseFunc // ends the campaign
	renewed chan struct{}           // receives after each renewal

	mu        sync.Mutex
	token     uint64    // 0 until this candidate first writes itself as holder
	renewedAt time.Time // when the newest successful write of this holder began
	other     string    // a holder of another configuration, seen once
	otherRaw  []byte    // its record then
}

func (k *lock) Get(ctx context.Context) (*rl.LeaderElectionRecord, []byte, error) {
	rec, raw, err := k.LeaseLock.Get(ctx)
	if err != nil {
		return rec, raw, err
	}
	if err := k.judge(rec, raw); err != nil {
		k.refuse(err)
		// An error, so that this try neither takes nor renews the Lease.
		return nil, nil, err
	}
	return rec, raw, nil
}

// judge refuses the Lease if its holder is another job's, or one of
// another configuration that has renewed since it was last seen.
func (k *lock) judge(rec *rl.LeaderElectionRecord, raw []byte) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	holder := rec.HolderIdentity
	if holder == "" || holder == k.id.String() {
		k.other, k.otherRaw = "", nil
		return nil
	}
	if err := k.l.foreignHolder(holder); err != nil {
		return err
	}
	id, _ := parseIdentity(holder)
	if id.config == k.id.config {
		k.other, k.otherRaw = "", nil
		return nil
	}
	if holder == k.other && !bytes.Equal(raw, k.otherRaw) {
		return &lease.ConfigError{Lease: "Lease " + k.l.desc, Job: k.id.job, Holder: id.name,
			HolderConfig: id.config, Config: k.id.config}
	}
	k.other, k.otherRaw = holder, raw
	return nil
}

func (k *lock) Create(ctx context.Context, ler rl.LeaderElectionRecord) error {
	began := time.Now()
	err := k.LeaseLock.Create(ctx, ler)
	if err == nil {
		k.wrote(ler, began)
	}
	return err
}

func (k *lock) Update(ctx context.Context, ler rl.LeaderElectionRecord) error {
	began := time.Now()
	err := k.LeaseLock.Update(ctx, ler)
	if err == nil {
		k.wrote(ler, began)
	}
	return err
}

// wrote notes a successful write of ler, begun at began.
func (k *lock) wrote(ler rl.LeaderElectionRecord, began time.Time) {
	if ler.HolderIdentity != k.id.String() {
		return // the release
	}
	k.mu.Lock()
	if k.token == 0 {
		k.token = uint64(ler.LeaderTransitions) + 1
	}
	k.renewedAt = began
	k.mu.Unlock()
	select {
	case k.renewed <- struct{}{}:
	default:
	}
}

func (k *lock) state() (token uint64, renewedAt time.Time) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.token, k.renewedAt
}

// term is a term of a Lease. Its goroutine ends it when a renewal is
// late, then stops the election; Resign then releases the Lease.
type term struct {
	l       *Lease
	k       *lock
	token   uint64
	ctx     context.Context
	end     context.CancelCauseFunc
	done    chan struct{} // closed once the election has stopped
	release sync.Once
}

// start starts the term that the election, running under run, began with
// lead; stop ends the election, elected is closed once it has ended.
func (l *Lease) start(parent context.Context, k *lock, run, lead context.Context, stop context.CancelCauseFunc, elected <-chan struct{}) *term {
	token, _ := k.state()
	ctx, end := context.WithCancelCause(context.WithoutCancel(parent))
	t := &term{l: l, k: k, token: token, ctx: ctx, end: end, done: make(chan struct{})}
	l.log.Info("lease: term taken", "token", token, "identity", k.id.String())
	go func() {
		defer close(t.done)
		t.watch(parent, run, lead)
		cause := context.Cause(ctx)
		l.log.Info("lease: term over", "token", token, "cause", cause)
		stop(cause)
		<-elected
	}()
	return t
}

// watch returns once the term is over, having ended it: resigned, the
// campaign's context ended, the election stopped leading, or a renewal
// not done within RenewDeadline of the start of the last one.
func (t *term) watch(parent, run, lead context.Context) {
	_, at := t.k.state()
	late := time.NewTimer(time.Until(at.Add(t.l.cfg.RenewDeadline)))
	defer late.Stop()
	for {
		select {
		case <-t.ctx.Done():
			return
		case <-parent.Done():
			t.end(fmt.Errorf("%w: Lease %s: the campaign's context ended: %w", lease.ErrLost, t.l.desc, context.Cause(parent)))
			return
		case <-lead.Done():
			switch {
			case parent.Err() != nil:
				t.end(fmt.Errorf("%w: Lease %s: the campaign's context ended: %w", lease.ErrLost, t.l.desc, context.Cause(parent)))
			case run.Err() != nil: // a refusal of the Lease's new holder
				t.end(fmt.Errorf("%w: Lease %s: term %d over: %w", lease.ErrLost, t.l.desc, t.token, context.Cause(run)))
			default:
				t.end(t.lostCause("over: the election stopped leading"))
			}
			return
		case <-t.k.renewed:
			_, at := t.k.state()
			late.Reset(time.Until(at.Add(t.l.cfg.RenewDeadline)))
		case <-late.C:
			t.end(t.lostCause(fmt.Sprintf("not renewed within RenewDeadline (%v)", t.l.cfg.RenewDeadline)))
			return
		}
	}
}

// lostCause is the cause of a term lost for why.
func (t *term) lostCause(why string) error {
	return fmt.Errorf("%w: Lease %s: term %d %s", lease.ErrLost, t.l.desc, t.token, why)
}

func (t *term) Token() uint64            { return t.token }
func (t *term) Context() context.Context { return t.ctx }

// Check reads the Lease from the API server: it must still name this
// term's holder, with this term's transitions, renewed within
// RenewDeadline. An error that does not wrap lease.ErrLost means the API
// server could not be asked: the term goes on, but the act should wait.
func (t *term) Check(ctx context.Context) error {
	if t.ctx.Err() != nil {
		return context.Cause(t.ctx)
	}
	got, err := t.l.cfg.Client.CoordinationV1().Leases(t.l.cfg.Namespace).Get(ctx, t.l.cfg.Name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		t.end(t.lostCause("is gone: the Lease was deleted"))
		return context.Cause(t.ctx)
	case err != nil:
		return fmt.Errorf("lease/kubernetes: Lease %s: cannot confirm term %d: %w", t.l.desc, t.token, err)
	}
	holder, transitions := "", int32(0)
	if got.Spec.HolderIdentity != nil {
		holder = *got.Spec.HolderIdentity
	}
	if got.Spec.LeaseTransitions != nil {
		transitions = *got.Spec.LeaseTransitions
	}
	_, at := t.k.state()
	switch {
	case holder != t.k.id.String() || uint64(transitions)+1 != t.token:
		t.end(t.lostCause(fmt.Sprintf("deposed: the Lease names %q with %d transitions", holder, transitions)))
	case time.Since(at) >= t.l.cfg.RenewDeadline:
		t.end(t.lostCause(fmt.Sprintf("not renewed within RenewDeadline (%v)", t.l.cfg.RenewDeadline)))
	}
	if t.ctx.Err() != nil {
		return context.Cause(t.ctx)
	}
	return nil
}

// Resign ends the term, waits for the election to stop renewing, and
// then releases the Lease if it still names this term's holder, which
// takes at most RenewDeadline. A term that ended without Resign stopped
// renewing but keeps the Lease: the other candidates wait LeaseDuration
// after its last renewal, as they do for a holder that died.
func (t *term) Resign() error {
	t.end(fmt.Errorf("%w: Lease %s: term %d resigned", lease.ErrLost, t.l.desc, t.token))
	<-t.done
	t.release.Do(t.k.release)
	return nil
}

// release hands the Lease over, as client-go's election does on its
// ReleaseOnCancel: no holder, held for 1 s, the same transitions; unless
// the Lease no longer names this holder. Call it once the election has
// stopped.
func (k *lock) release() {
	ctx, cancel := context.WithTimeout(context.Background(), k.l.cfg.RenewDeadline)
	defer cancel()
	rec, _, err := k.LeaseLock.Get(ctx)
	switch {
	case err != nil:
		k.l.log.Warn("lease: cannot release the Lease; the others take it once it runs out", "err", err)
		return
	case rec.HolderIdentity != k.id.String():
		return
	}
	now := metav1.NewTime(time.Now())
	err = k.LeaseLock.Update(ctx, rl.LeaderElectionRecord{LeaderTransitions: rec.LeaderTransitions,
		LeaseDurationSeconds: 1, RenewTime: now, AcquireTime: now})
	if err != nil {
		k.l.log.Warn("lease: cannot release the Lease; the others take it once it runs out", "err", err)
		return
	}
	k.l.log.Info("lease: Lease released", "identity", k.id.String())
}

func randomHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}
