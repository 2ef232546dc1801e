// Package lease elects the leader among a job's managers, so that a
// standby takes over when the leader dies, and fences the leader so that a
// deposed one can do no harm.
//
// Each manager campaigns for the job's Lease; the one whose Campaign
// returns holds a Term until it is lost or resigned, and the others wait.
// Every term carries a fencing token greater than every earlier term's.
// A holder does its work under the term's Context, which ends as soon as
// the term is lost, calls Term.Check before an act that two managers must
// never both do, and sends its token with each command; whatever receives
// commands keeps a Fence, which refuses the acts of any older term.
//
// Two leases are here. File keeps the lease in a lock file (flock) and the
// newest term in a lease file beside it, for managers on one machine or on
// a shared filesystem; it refuses at start a filesystem whose locks do not
// work. Package lease/kubernetes keeps it in a coordination.k8s.io Lease
// through client-go's leader election, apart so that this package does
// not compile client-go.
//
// A lease belongs to one job, and its holder's configuration is known: a
// lease of another job is refused (ErrForeign), and so is a candidate
// while a holder with another configuration lives (*ConfigError): two
// managers of one job must run it alike.
//
// taskd.Lead runs a taskd manager this way. A manager's loop:
//
//	l, err := lease.NewFile(lease.FileConfig{
//		Path:      "/shared/llm/manager.lease",
//		Candidate: lease.Candidate{Job: "llm", Config: lease.ConfigHash(jobConfig)},
//	})
//	...
//	for {
//		term, err := l.Campaign(ctx)
//		if err != nil {
//			return err // ctx ended, or the lease refused this manager
//		}
//		err = lead(term.Context(), term) // until the term is lost
//		term.Resign()                    // once lead's work has stopped
//		...
//	}
package lease
