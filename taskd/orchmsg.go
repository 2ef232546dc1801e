package taskd

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"time"
)

// Kinds of the messages that orchestration sends to workers. The prefix is
// reserved: a message of such a kind goes to WorkerConfig.Trainer, never
// to OnMessage.
const (
	orchPrefix = "taskd/"
	kindPause  = orchPrefix + "pause"
	kindNotice = orchPrefix + "notice"
	kindRetry  = orchPrefix + "retry"
	kindResume = orchPrefix + "resume"
	kindSwitch = orchPrefix + "switch-link"
	kindStress = orchPrefix + "stress-test"
	kindStop   = orchPrefix + "stop"
)

func isOrchestration(kind string) bool { return strings.HasPrefix(kind, orchPrefix) }

// orchMsg is the payload of an orchestration message, as JSON.
type orchMsg struct {
	// TimeoutMS is the manager's deadline for the call; the trainer's
	// context ends then.
	TimeoutMS int64          `json:"timeout_ms,omitempty"`
	Resume    *ResumeRequest `json:"resume,omitempty"`
	Notice    *FaultNotice   `json:"notice,omitempty"`
	Link      *LinkRequest   `json:"link,omitempty"`
	Stress    *StressRequest `json:"stress,omitempty"`
	Reason    string         `json:"reason,omitempty"`
	// Once names a command that a worker carries out once: a retry or
	// resume that a manager which took over sends again is answered, not
	// carried out twice.
	Once string `json:"once,omitempty"`
}

// orchReply is a worker's answer to an orchestration message, as JSON.
type orchReply struct {
	Step       *int64     `json:"step,omitempty"`
	Strategies []Strategy `json:"strategies,omitempty"`
}

// callTrainer carries out one orchestration message on t.
func callTrainer(ctx context.Context, t Trainer, kind string, payload []byte) ([]byte, error) {
	var msg orchMsg
	if len(payload) > 0 {
		if err := json.Unmarshal(payload, &msg); err != nil {
			return nil, fmt.Errorf("taskd: %s payload: %w", kind, err)
		}
	}
	if msg.TimeoutMS > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, time.Duration(msg.TimeoutMS)*time.Millisecond)
		defer cancel()
	}
	var reply orchReply
	var err error
	switch kind {
	case kindPause:
		var step int64
		step, err = t.Pause(ctx)
		reply.Step = &step
	case kindNotice:
		var n FaultNotice
		if msg.Notice != nil {
			n = *msg.Notice
		}
		reply.Strategies, err = strategiesOf(ctx, t, n)
		if reply.Strategies == nil {
			reply.Strategies = []Strategy{}
		}
	case kindRetry:
		r, ok := t.(StepRetrier)
		if !ok {
			return nil, fmt.Errorf("taskd: %s: the trainer is no StepRetrier: %w", kind, ErrUnsupported)
		}
		err = r.RetryStep(ctx)
	case kindResume:
		r := ResumeRequest{Step: -1}
		if msg.Resume != nil {
			r = *msg.Resume
		}
		err = t.Resume(ctx, r)
	case kindSwitch:
		if msg.Link == nil {
			return nil, fmt.Errorf("taskd: %s: no link", kind)
		}
		l, ok := t.(LinkSwitcher)
		if !ok {
			return nil, fmt.Errorf("taskd: %s: the trainer is no LinkSwitcher: %w", kind, ErrUnsupported)
		}
		err = l.SwitchLink(ctx, *msg.Link)
	case kindStress:
		if msg.Stress == nil {
			return nil, fmt.Errorf("taskd: %s: no test", kind)
		}
		st, ok := t.(StressTester)
		if !ok {
			return nil, fmt.Errorf("taskd: %s: the trainer is no StressTester: %w", kind, ErrUnsupported)
		}
		err = st.StressTest(ctx, *msg.Stress)
	case kindStop:
		err = t.Stop(ctx, msg.Reason)
	default:
		return nil, fmt.Errorf("taskd: unknown orchestration message %q", kind)
	}
	if err != nil {
		return nil, err
	}
	return json.Marshal(reply)
}

// onceOf returns the Once key of an orchestration message's payload, ""
// when it has none.
func onceOf(payload []byte) string {
	var msg struct {
		Once string `json:"once"`
	}
	if json.Unmarshal(payload, &msg) != nil {
		return ""
	}
	return msg.Once
}

// parseReply reads a worker's answer; an empty one is a zero answer.
func parseReply(b []byte) (orchReply, error) {
	var r orchReply
	if len(b) == 0 {
		return r, nil
	}
	err := json.Unmarshal(b, &r)
	return r, err
}
