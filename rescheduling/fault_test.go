package rescheduling

import (
	"syscall"
	"testing"
)

func TestClassify(t *testing.T) {
	tests := []struct {
		name string
		f    Fault
		want Class
	}{
		{"exit 137 killed", Fault{Kind: KindExit, ExitCode: 137}, ClassKilled},
		{"exit 143 terminated", Fault{Kind: KindExit, ExitCode: 143}, ClassKilled},
		{"SIGKILL", Fault{Kind: KindExit, ExitCode: 137, Signal: syscall.SIGKILL}, ClassKilled},
		{"SIGTERM", Fault{Kind: KindExit, Signal: syscall.SIGTERM}, ClassKilled},
		{"exit 247 oom", Fault{Kind: KindExit, ExitCode: 247}, ClassOOM},
		{"OOMKilled wins over 137", Fault{Kind: KindExit, ExitCode: 137, Reason: "OOMKilled"}, ClassOOM},
		{"oomkilled any case", Fault{Kind: KindExit, ExitCode: 137, Reason: "oomkilled"}, ClassOOM},
		{"exit 1 fatal", Fault{Kind: KindExit, ExitCode: 1}, ClassFatal},
		{"exit 134 core dump", Fault{Kind: KindExit, ExitCode: 134}, ClassFatal},
		{"SIGABRT", Fault{Kind: KindExit, ExitCode: 134, Signal: syscall.SIGABRT}, ClassFatal},
		{"exit 201 gpu driver", Fault{Kind: KindExit, ExitCode: 201}, ClassHardware},
		{"exit 202 gpu residue", Fault{Kind: KindExit, ExitCode: 202}, ClassHardware},
		{"exit 14 inforom", Fault{Kind: KindExit, ExitCode: 14}, ClassHardware},
		{"exit 2 unknown", Fault{Kind: KindExit, ExitCode: 2}, ClassUnknown},
		{"exit 255 unknown", Fault{Kind: KindExit, ExitCode: 255}, ClassUnknown},
		{"exit -1 unknown", Fault{Kind: KindExit, ExitCode: -1}, ClassUnknown},
		{"exit 100000 unknown", Fault{Kind: KindExit, ExitCode: 100000}, ClassUnknown},
		{"SIGSEGV unknown", Fault{Kind: KindExit, ExitCode: 139, Signal: syscall.SIGSEGV}, ClassUnknown},
		{"signal beats exit code", Fault{Kind: KindExit, ExitCode: 1, Signal: syscall.SIGKILL}, ClassKilled},
		{"exit 0 is no fault", Fault{Kind: KindExit, ExitCode: 0}, ClassNone},
		{"hang", Fault{Kind: KindHang}, ClassHang},
		{"slow", Fault{Kind: KindSlow}, ClassSlow},
		{"heartbeat", Fault{Kind: KindHeartbeat}, ClassHeartbeat},
		{"node NotReady", Fault{Kind: KindNode, Reason: "NotReady"}, ClassNode},
		{"membership", Fault{Kind: KindMembership}, ClassMembership},
		{"log with class", Fault{Kind: KindLog, Class: ClassOOM}, ClassOOM},
		{"log without class", Fault{Kind: KindLog}, ClassUnknown},
		{"preset class wins", Fault{Kind: KindExit, ExitCode: 137, Class: ClassHardware}, ClassHardware},
		{"out-of-range class ignored", Fault{Kind: KindExit, ExitCode: 1, Class: 200}, ClassFatal},
		{"zero fault", Fault{}, ClassUnknown},
		{"invalid kind", Fault{Kind: 99, ExitCode: 137}, ClassUnknown},
	}
	for _, tt := range tests {
		if got := Classify(tt.f); got != tt.want {
			t.Errorf("%s: Classify(%+v) = %s, want %s", tt.name, tt.f, got, tt.want)
		}
	}
}

func TestNames(t *testing.T) {
	for c := Unclassified; c < numClasses; c++ {
		if c.String() == "" {
			t.Errorf("class %d has no name", c)
		}
	}
	if got := Class(250).String(); got != "class(250)" {
		t.Errorf("Class(250) = %q", got)
	}
	if got := Kind(250).String(); got != "kind(250)" {
		t.Errorf("Kind(250) = %q", got)
	}
	if got := Action(250).String(); got != "action(250)" {
		t.Errorf("Action(250) = %q", got)
	}
	if got := RecreatePods.String(); got != "recreate_pods" {
		t.Errorf("RecreatePods = %q", got)
	}
}
