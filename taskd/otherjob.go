package taskd

import (
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// reasonUnknownJob is the ErrorInfo reason of a call refused for naming a
// job its server does not serve; the metadata's "serves" names the one it
// does, so that a worker whose job went on under another name (a launcher
// whose elastic job changed its shape without it) can find it.
const reasonUnknownJob = "UNKNOWN_JOB"

// unknownJob is the refusal of a call for job by a server (who: "manager",
// "proxy") of served.
func unknownJob(job, who, served string) error {
	st := status.Newf(codes.NotFound, "taskd: unknown job %q (this %s serves %q)", job, who, served)
	if d, err := st.WithDetails(&errdetails.ErrorInfo{Reason: reasonUnknownJob, Domain: "taskd", Metadata: map[string]string{"serves": served}}); err == nil {
		st = d
	}
	return st.Err()
}

// servedJob returns the job an unknownJob refusal says its server serves.
func servedJob(err error) (string, bool) {
	st, ok := status.FromError(err)
	if !ok || st.Code() != codes.NotFound {
		return "", false
	}
	for _, d := range st.Details() {
		if e, ok := d.(*errdetails.ErrorInfo); ok && e.GetReason() == reasonUnknownJob && e.GetDomain() == "taskd" && e.GetMetadata()["serves"] != "" {
			return e.GetMetadata()["serves"], true
		}
	}
	return "", false
}
