package taskd

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "github.com/faultline-ml/faultline/internal/taskdpb"
)

// uplink queues a member's reports and sends them upward, in order,
// retrying until the manager acknowledges each. Worker and Proxy share it.
type uplink struct {
	job        string
	self       *pb.Member
	queue      *reportQueue
	seq        atomic.Uint64
	maxMsg     int
	ackTimeout time.Duration
	log        *slog.Logger
	overflow   func()
	queued     func(int)
}

func (u *uplink) nextID() string {
	return u.self.GetInstance() + "/" + strconv.FormatUint(u.seq.Add(1), 10)
}

func (u *uplink) enqueue(r *pb.Report) error {
	if s := proto.Size(r); s > u.maxMsg/4 {
		return fmt.Errorf("%w: report of %d bytes, cap %d", ErrTooLarge, s, u.maxMsg/4)
	}
	if err := u.queue.push(r); err != nil {
		u.overflow()
		return err
	}
	u.queued(u.queue.len())
	return nil
}

// reportFault queues f. An empty ID is filled in, an empty Kind is an
// error, and a zero Time means now.
func (u *uplink) reportFault(f Fault) error {
	if err := checkKind(f.Kind); err != nil {
		return fmt.Errorf("taskd: Fault.Kind: %w", err)
	}
	if f.ID == "" {
		f.ID = u.nextID()
	}
	if f.Time.IsZero() {
		f.Time = time.Now()
	}
	return u.enqueue(&pb.Report{
		Id: f.ID, From: u.self, TimeUnixNano: f.Time.UnixNano(),
		Body: &pb.Report_Fault{Fault: &pb.FaultReport{Kind: string(f.Kind), Node: int32(f.Position.Node), Rank: int32(f.Position.Rank), Code: int32(f.Code), Message: f.Message, Attrs: f.Attrs}},
	})
}

func (u *uplink) send(kind string, payload []byte) error {
	if kind == "" {
		return fmt.Errorf("taskd: message kind: empty")
	}
	return u.enqueue(&pb.Report{
		Id: u.nextID(), From: u.self, TimeUnixNano: time.Now().UnixNano(),
		Body: &pb.Report_Message{Message: &pb.UserMessage{Kind: kind, Payload: payload}},
	})
}

// run sends queued reports until ctx ends; each call is acknowledged by its
// response or retried with backoff.
func (u *uplink) run(ctx context.Context, client pb.ControlClient) error {
	bo := newBackoff(100*time.Millisecond, 5*time.Second)
	for {
		if u.queue.len() == 0 {
			select {
			case <-ctx.Done():
				return nil
			case <-u.queue.wake:
				continue
			}
		}
		if err := u.sendBatch(ctx, client); err != nil {
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(bo.NextBackOff()):
			}
			continue
		}
		bo.Reset()
	}
}

// sendBatch sends the oldest queued reports in one call and drops those
// the manager accepted, or refused as invalid (retrying cannot help them).
func (u *uplink) sendBatch(ctx context.Context, client pb.ControlClient) error {
	batch := u.queue.peek(256, u.maxMsg/2)
	if len(batch) == 0 {
		return nil
	}
	cctx, cancel := context.WithTimeout(ctx, u.ackTimeout)
	resp, err := client.Send(cctx, &pb.SendRequest{Job: u.job, Reports: batch})
	cancel()
	switch status.Code(err) {
	case codes.InvalidArgument, codes.PermissionDenied:
		u.log.Error("taskd: reports refused by the manager, dropped", "count", len(batch), "err", err)
		ids := make([]string, len(batch))
		for i, r := range batch {
			ids[i] = r.GetId()
		}
		u.queue.remove(ids)
	case codes.OK:
		u.queue.remove(resp.GetAccepted())
	default:
		return err
	}
	u.queued(u.queue.len())
	return nil
}

// maxAckBatch and ackBatchBytes bound the acknowledgements sent in one
// call, well within the bound of an Acknowledge message (methodLimits).
const (
	maxAckBatch   = 1024
	ackBatchBytes = 256 << 10
)

// runAcks forwards acknowledgements in batches; one that fails is dropped,
// since the sender re-sends what it does not see acknowledged. A batch cut
// short by ctx goes back to acks, for a flush on the way out.
func runAcks(ctx context.Context, client pb.ControlClient, job string, acks chan *pb.Ack, timeout time.Duration, log *slog.Logger) error {
	for {
		var batch []*pb.Ack
		select {
		case <-ctx.Done():
			return nil
		case a := <-acks:
			batch = append(batch, a)
		}
		size := proto.Size(batch[0])
	drain:
		for len(batch) < maxAckBatch && size < ackBatchBytes {
			select {
			case a := <-acks:
				batch = append(batch, a)
				size += proto.Size(a)
			default:
				break drain
			}
		}
		cctx, cancel := context.WithTimeout(ctx, timeout)
		_, err := client.Acknowledge(cctx, &pb.AckRequest{Job: job, Acks: batch})
		cancel()
		switch {
		case err == nil:
		case ctx.Err() != nil:
			for _, a := range batch {
				select {
				case acks <- a:
				default:
				}
			}
			return nil
		default:
			log.Debug("taskd: acknowledgements not delivered; the sender will re-send", "count", len(batch), "err", err)
		}
	}
}
