package kubernetes

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/goleak"
	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/utils/ptr"

	"github.com/faultline-ml/faultline/taskd/lease"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

const (
	ns       = "training"
	name     = "llm-manager"
	configX  = "3f2a9c1e0b7d4a65"
	configY  = "0123456789abcdef"
	leaseDur = DefaultLeaseDuration
	renewDur = DefaultRenewDeadline
	retryDur = DefaultRetryPeriod
)

// cluster is a fake API server whose Leases keep resourceVersions as a
// real one does, so that two candidates' writes conflict; and whose
// writes from a candidate can be cut off.
type cluster struct {
	cs *fake.Clientset

	mu  sync.Mutex
	rv  int
	cut string // writes by this candidate fail, as if it were gone
}

func newCluster(objs ...runtime.Object) *cluster {
	c := &cluster{cs: fake.NewClientset(objs...)}
	c.cs.PrependReactor("create", "leases", func(a k8stesting.Action) (bool, runtime.Object, error) {
		l := a.(k8stesting.CreateAction).GetObject().(*coordinationv1.Lease)
		l.ResourceVersion = c.nextRV()
		return false, nil, nil
	})
	c.cs.PrependReactor("update", "leases", func(a k8stesting.Action) (bool, runtime.Object, error) {
		l := a.(k8stesting.UpdateAction).GetObject().(*coordinationv1.Lease)
		cur, err := c.cs.Tracker().Get(a.GetResource(), a.GetNamespace(), l.Name)
		if err != nil {
			return false, nil, nil
		}
		if cur.(*coordinationv1.Lease).ResourceVersion != l.ResourceVersion {
			return true, nil, apierrors.NewConflict(a.GetResource().GroupResource(), l.Name, errors.New("the object has been modified"))
		}
		l.ResourceVersion = c.nextRV()
		return false, nil, nil
	})
	// Before the resourceVersions: a cut-off candidate's renewals and
	// release fail; another's takeover succeeds.
	c.cs.PrependReactor("update", "leases", func(a k8stesting.Action) (bool, runtime.Object, error) {
		c.mu.Lock()
		cut := c.cut
		c.mu.Unlock()
		if cut == "" {
			return false, nil, nil
		}
		l := a.(k8stesting.UpdateAction).GetObject().(*coordinationv1.Lease)
		cur, err := c.cs.Tracker().Get(a.GetResource(), a.GetNamespace(), l.Name)
		if err != nil {
			return false, nil, nil
		}
		was, now := holderOf(cur.(*coordinationv1.Lease)), holderOf(l)
		if strings.HasPrefix(was, cut+"/") && (now == "" || strings.HasPrefix(now, cut+"/")) {
			return true, nil, apierrors.NewServiceUnavailable(cut + " is cut off")
		}
		return false, nil, nil
	})
	return c
}

func (c *cluster) nextRV() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.rv++
	return strconv.Itoa(c.rv)
}

// cutOff makes every write of the candidate named name fail.
func (c *cluster) cutOff(name string) {
	c.mu.Lock()
	c.cut = name
	c.mu.Unlock()
}

func (c *cluster) lease(t *testing.T) *coordinationv1.Lease {
	t.Helper()
	l, err := c.cs.CoordinationV1().Leases(ns).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// writesBy returns the writes to the Lease that named candidate as holder.
func (c *cluster) writesBy(candidate string) int {
	n := 0
	for _, a := range c.cs.Actions() {
		var obj runtime.Object
		switch a := a.(type) {
		case k8stesting.CreateAction:
			obj = a.GetObject()
		case k8stesting.UpdateAction:
			obj = a.GetObject()
		}
		if l, ok := obj.(*coordinationv1.Lease); ok && strings.HasPrefix(holderOf(l), candidate+"/") {
			n++
		}
	}
	return n
}

func holderOf(l *coordinationv1.Lease) string {
	if l.Spec.HolderIdentity == nil {
		return ""
	}
	return *l.Spec.HolderIdentity
}

func newLease(t *testing.T, c *cluster, candidate, config string) *Lease {
	t.Helper()
	l, err := New(Config{Client: c.cs, Namespace: ns, Name: name,
		Candidate: lease.Candidate{Job: "llm", Config: config, Name: candidate}})
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// campaignAsync campaigns in a goroutine; the channel receives the term,
// or nil and the error.
type result struct {
	term lease.Term
	err  error
	at   time.Time
}

func campaignAsync(ctx context.Context, l *Lease) <-chan result {
	ch := make(chan result, 1)
	go func() {
		term, err := l.Campaign(ctx)
		ch <- result{term, err, time.Now()}
	}()
	return ch
}

// TestTakeoverAfterHolderGone: the holder is cut off from the API server,
// as a manager that died or lost its network; its term ends RenewDeadline
// after its last renewal at the latest, strictly before the standby takes
// the Lease, LeaseDuration after it last saw a renewal, with the next
// token. The old term's Check fails and a fence refuses its token.
func TestTakeoverAfterHolderGone(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := newCluster()
		ctx := t.Context()
		ta, err := newLease(t, c, "a", configX).Campaign(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer ta.Resign()
		if ta.Token() != 1 {
			t.Errorf("first token = %d, want 1", ta.Token())
		}
		var fence lease.Fence
		fence.Admit(ta.Token())
		standby := campaignAsync(ctx, newLease(t, c, "b", configX))
		time.Sleep(3 * leaseDur) // a renews; b waits
		synctest.Wait()
		select {
		case r := <-standby:
			t.Fatalf("b's campaign returned while a renews: %v", r.err)
		default:
		}

		cutAt := time.Now()
		c.cutOff("a")
		<-ta.Context().Done()
		lostAt := time.Now()
		r := <-standby
		if r.err != nil {
			t.Fatal(r.err)
		}
		defer r.term.Resign()
		t.Logf("a cut off at 0, its term over at %v, b's taken at %v", lostAt.Sub(cutAt), r.at.Sub(cutAt))
		if !lostAt.Before(r.at) {
			t.Errorf("a's term ended at %v, not before b's began at %v", lostAt.Sub(cutAt), r.at.Sub(cutAt))
		}
		if lostAt.Sub(cutAt) > renewDur {
			t.Errorf("a's term ended %v after its last renewal could have been, more than RenewDeadline %v", lostAt.Sub(cutAt), renewDur)
		}
		if cause := context.Cause(ta.Context()); !errors.Is(cause, lease.ErrLost) || !strings.Contains(cause.Error(), "RenewDeadline") {
			t.Errorf("a's cause = %v", cause)
		}
		if r.term.Token() != 2 {
			t.Errorf("b's token = %d, want 2", r.term.Token())
		}
		if l := c.lease(t); !strings.HasPrefix(holderOf(l), "b/") || *l.Spec.LeaseTransitions != 1 {
			t.Errorf("Lease holder %q, transitions %d", holderOf(l), *l.Spec.LeaseTransitions)
		}
		if err := ta.Check(ctx); !errors.Is(err, lease.ErrLost) {
			t.Errorf("a's Check = %v", err)
		}
		if err := r.term.Check(ctx); err != nil {
			t.Errorf("b's Check = %v", err)
		}
		if err := fence.Admit(r.term.Token()); err != nil {
			t.Error(err)
		}
		if err := fence.Admit(ta.Token()); !errors.Is(err, lease.ErrStale) {
			t.Errorf("a's act after the takeover: %v", err)
		}
	})
}

// TestResignHandsOver: a holder that resigns releases the Lease, and the
// standby takes it at its next try, not LeaseDuration later.
func TestResignHandsOver(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := newCluster()
		ctx := t.Context()
		ta, err := newLease(t, c, "a", configX).Campaign(ctx)
		if err != nil {
			t.Fatal(err)
		}
		standby := campaignAsync(ctx, newLease(t, c, "b", configX))
		time.Sleep(leaseDur)
		resigned := time.Now()
		ta.Resign()
		if err := context.Cause(ta.Context()); !errors.Is(err, lease.ErrLost) || !strings.Contains(err.Error(), "resigned") {
			t.Errorf("cause = %v", err)
		}
		r := <-standby
		if r.err != nil {
			t.Fatal(r.err)
		}
		defer r.term.Resign()
		// A try every RetryPeriod, jittered by up to 1.2 times more.
		if d := r.at.Sub(resigned); d > retryDur+time.Duration(1.2*float64(retryDur)) {
			t.Errorf("b took the Lease %v after a resigned, more than a jittered RetryPeriod", d)
		}
		if r.term.Token() != 2 {
			t.Errorf("b's token = %d, want 2", r.term.Token())
		}
	})
}

// TestEndedTermKeepsLeaseUntilResign: a term whose campaign's context
// ends (taskd-manager's SIGTERM) stops renewing but does not release the
// Lease: the standby does not take it while the holder still stops the
// work done under the term, and takes it at its next try once the holder
// resigns.
func TestEndedTermKeepsLeaseUntilResign(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := newCluster()
		ctx, cancel := context.WithCancel(t.Context())
		ta, err := newLease(t, c, "a", configX).Campaign(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer ta.Resign()
		standby := campaignAsync(t.Context(), newLease(t, c, "b", configX))
		time.Sleep(retryDur)
		cancel()
		<-ta.Context().Done()
		time.Sleep(renewDur) // a stops its work, within LeaseDuration
		synctest.Wait()
		select {
		case r := <-standby:
			if r.term != nil {
				r.term.Resign()
			}
			t.Fatalf("b's campaign returned before a resigned: %v", r.err)
		default:
		}
		resigned := time.Now()
		ta.Resign()
		r := <-standby
		if r.err != nil {
			t.Fatal(r.err)
		}
		defer r.term.Resign()
		if d := r.at.Sub(resigned); d > retryDur+time.Duration(1.2*float64(retryDur)) {
			t.Errorf("b took the Lease %v after a resigned, more than a jittered RetryPeriod", d)
		}
	})
}

// TestCampaignWaitsOutAPIErrors: a campaign that cannot read the Lease
// (the API server restarting, a 503, a timeout), as a standby starts or a
// leader whose term an outage ended campaigns again, keeps trying until
// it holds the Lease, as client-go's election does.
func TestCampaignWaitsOutAPIErrors(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := newCluster()
		var mu sync.Mutex
		failures := 3 // the GETs that fail next; -1: every one
		c.cs.PrependReactor("get", "leases", func(k8stesting.Action) (bool, runtime.Object, error) {
			mu.Lock()
			defer mu.Unlock()
			if failures == 0 {
				return false, nil, nil
			}
			if failures > 0 {
				failures--
			}
			if failures%2 == 0 {
				return true, nil, apierrors.NewServiceUnavailable("the API server is restarting")
			}
			return true, nil, apierrors.NewTimeoutError("request timed out", 1)
		})
		ta, err := newLease(t, c, "a", configX).Campaign(t.Context())
		if err != nil {
			t.Fatalf("Campaign gave up on an error of the API server: %v", err)
		}
		defer ta.Resign()
		if ta.Token() != 1 {
			t.Errorf("token = %d, want 1", ta.Token())
		}
		ctx, cancel := context.WithCancelCause(t.Context())
		mu.Lock()
		failures = -1
		mu.Unlock()
		standby := campaignAsync(ctx, newLease(t, c, "b", configX))
		time.Sleep(leaseDur)
		stop := errors.New("shutting down")
		cancel(stop)
		if r := <-standby; !errors.Is(r.err, stop) {
			t.Errorf("Campaign through an outage, its context ended = %v, want %v", r.err, stop)
		}
	})
}

// TestCheckSeesDeposal: Check reads the Lease: a holder whose Lease names
// another holder learns of it at once.
func TestCheckSeesDeposal(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := newCluster()
		ctx := t.Context()
		ta, err := newLease(t, c, "a", configX).Campaign(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer ta.Resign()
		if err := ta.Check(ctx); err != nil {
			t.Fatalf("Check of the holder: %v", err)
		}
		l := c.lease(t)
		l.Spec.HolderIdentity = ptr.To("c/0000000000000000 config=" + configX + " job=llm")
		l.Spec.LeaseTransitions = ptr.To(*l.Spec.LeaseTransitions + 1)
		if _, err := c.cs.CoordinationV1().Leases(ns).Update(ctx, l, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		err = ta.Check(ctx)
		if !errors.Is(err, lease.ErrLost) || !strings.Contains(err.Error(), "deposed") || !strings.Contains(err.Error(), "c/0000000000000000") {
			t.Errorf("Check = %v", err)
		}
		if ta.Context().Err() == nil {
			t.Error("the term goes on")
		}
	})
}

// TestTokenFollowsLeaseTransitions: a Lease that its last holder released
// is taken with the next transition, and the token is that count plus one.
func TestTokenFollowsLeaseTransitions(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		released := &coordinationv1.Lease{
			ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Labels: map[string]string{JobLabel: "llm"}},
			Spec: coordinationv1.LeaseSpec{HolderIdentity: ptr.To(""), LeaseTransitions: ptr.To[int32](41),
				LeaseDurationSeconds: ptr.To[int32](1), RenewTime: &metav1.MicroTime{Time: time.Now().Add(-time.Hour)}},
		}
		c := newCluster(released)
		ta, err := newLease(t, c, "a", configX).Campaign(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		defer ta.Resign()
		if l := c.lease(t); *l.Spec.LeaseTransitions != 42 || ta.Token() != 43 {
			t.Errorf("transitions %d, token %d; want 42 and 43", *l.Spec.LeaseTransitions, ta.Token())
		}
	})
}

// TestRefusesAnotherConfig: a candidate of another configuration is
// refused, with both named, once it has seen the holder renew; it never
// writes the Lease.
func TestRefusesAnotherConfig(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := newCluster()
		ctx := t.Context()
		ta, err := newLease(t, c, "a", configX).Campaign(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer ta.Resign()
		_, err = newLease(t, c, "b", configY).Campaign(ctx)
		var ce *lease.ConfigError
		if !errors.As(err, &ce) || !errors.Is(err, lease.ErrConfig) {
			t.Fatalf("Campaign = %v, want a *lease.ConfigError", err)
		}
		for _, s := range []string{ns + "/" + name, `"llm"`, " a ", configX, configY} {
			if !strings.Contains(err.Error(), s) {
				t.Errorf("error %q does not name %q", err, s)
			}
		}
		if n := c.writesBy("b"); n != 0 {
			t.Errorf("b wrote the Lease %d times", n)
		}
		if err := ta.Check(ctx); err != nil {
			t.Errorf("a's term: %v", err)
		}
	})
}

// TestTakesOverFromAnotherConfigGone: a holder of another configuration
// that renews no more is taken over, as a rolling update's new managers
// do once the old leader is gone.
func TestTakesOverFromAnotherConfigGone(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := newCluster()
		ctx := t.Context()
		ta, err := newLease(t, c, "a", configX).Campaign(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer ta.Resign()
		c.cutOff("a")
		tb, err := newLease(t, c, "b", configY).Campaign(ctx)
		if err != nil {
			t.Fatalf("Campaign: %v", err)
		}
		defer tb.Resign()
		if tb.Token() != 2 {
			t.Errorf("token = %d, want 2", tb.Token())
		}
	})
}

// TestRefusesAnotherJobsLease: a Lease held by another job's manager or by
// something else, or labelled for another job, is refused and left alone,
// however long ago it was renewed.
func TestRefusesAnotherJobsLease(t *testing.T) {
	old := &metav1.MicroTime{Time: time.Now().Add(-time.Hour)}
	for _, tt := range []struct {
		name   string
		holder string
		labels map[string]string
		msg    string
	}{
		{"another program", "kube-controller-manager_4f1c", nil, `held by "kube-controller-manager_4f1c"`},
		{"another job", "m/0000000000000000 config=" + configX + " job=other", nil, "job=other"},
		{"labelled for another job", "", map[string]string{JobLabel: "other"}, JobLabel + "=other"},
	} {
		synctest.Test(t, func(t *testing.T) {
			existing := &coordinationv1.Lease{
				ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Labels: tt.labels},
				Spec: coordinationv1.LeaseSpec{HolderIdentity: ptr.To(tt.holder), LeaseTransitions: ptr.To[int32](3),
					LeaseDurationSeconds: ptr.To[int32](15), RenewTime: old},
			}
			c := newCluster(existing)
			_, err := newLease(t, c, "a", configX).Campaign(t.Context())
			if !errors.Is(err, lease.ErrForeign) || !strings.Contains(err.Error(), tt.msg) || !strings.Contains(err.Error(), ns+"/"+name) {
				t.Errorf("%s: Campaign = %v", tt.name, err)
			}
			if n := c.writesBy("a"); n != 0 {
				t.Errorf("%s: a wrote the Lease", tt.name)
			}
		})
	}
}

// TestCampaignContext: a campaign ends with its context, and so does a
// term, with a cause wrapping lease.ErrLost.
func TestCampaignContext(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := newCluster()
		ta, err := newLease(t, c, "a", configX).Campaign(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		defer ta.Resign()
		ctx, cancel := context.WithCancelCause(t.Context())
		standby := campaignAsync(ctx, newLease(t, c, "b", configX))
		stop := errors.New("shutting down")
		time.Sleep(retryDur)
		cancel(stop)
		if r := <-standby; !errors.Is(r.err, stop) {
			t.Errorf("Campaign = %v, want %v", r.err, stop)
		}

		ctx, cancel = context.WithCancelCause(t.Context())
		ta.Resign()
		tc, err := newLease(t, c, "c", configX).Campaign(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tc.Resign()
		cancel(stop)
		<-tc.Context().Done()
		if err := context.Cause(tc.Context()); !errors.Is(err, lease.ErrLost) || !errors.Is(err, stop) {
			t.Errorf("cause = %v", err)
		}
	})
}

func TestConfigValidate(t *testing.T) {
	good := Config{Client: fake.NewClientset(), Name: name, Candidate: lease.Candidate{Job: "llm", Config: configX}}
	for _, tt := range []struct {
		edit func(*Config)
		msg  string
	}{
		{func(c *Config) { c.Client = nil }, "Client"},
		{func(c *Config) { c.Name = "" }, "Name"},
		{func(c *Config) { c.Name = "Bad_Name" }, "Name"},
		{func(c *Config) { c.Namespace = "a.b" }, "Namespace"},
		{func(c *Config) { c.RetryPeriod = -1 }, "RetryPeriod"},
		{func(c *Config) { c.RenewDeadline = 20 * time.Second }, "LeaseDuration > RenewDeadline"},
		{func(c *Config) { c.RetryPeriod = 9 * time.Second }, "LeaseDuration > RenewDeadline"},
		{func(c *Config) { c.Candidate.Config = "" }, "Config"},
	} {
		c := good
		tt.edit(&c)
		if _, err := New(c); err == nil || !strings.Contains(err.Error(), tt.msg) {
			t.Errorf("New with a bad %s: %v", tt.msg, err)
		}
	}
	if _, err := New(good); err != nil {
		t.Error(err)
	}
}

func TestIdentity(t *testing.T) {
	id := identity{name: "llm-manager-7d9f-xk2lq", term: "9b1f03c2e4d5a6b7", config: configX, job: "llm pretrain"}
	got, ok := parseIdentity(id.String())
	if !ok || got != id {
		t.Errorf("parseIdentity(%q) = %+v, %v", id.String(), got, ok)
	}
	for _, s := range []string{"", "kube-scheduler", "a/b config=c", "a config=c job=j", "/t config=c job=j"} {
		if _, ok := parseIdentity(s); ok {
			t.Errorf("parseIdentity(%q) succeeded", s)
		}
	}
	if got := jobLabel("llm"); got != "llm" {
		t.Errorf("jobLabel(llm) = %q", got)
	}
	if got := jobLabel("a job/with spaces"); !strings.HasPrefix(got, "sha-") || len(got) != 20 {
		t.Errorf("jobLabel = %q", got)
	}
}
