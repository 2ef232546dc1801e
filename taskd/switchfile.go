package taskd

import (
	"context"

	"github.com/faultline-ml/faultline/trace"
)

// SwitchFile returns a SwitchSource that follows a profilingSwitch file,
// typically a ConfigMap mounted at trace.DefaultSwitchPath, through
// trace.SwitchWatcher: inotify on the folder (the kubelet's "..data" swap
// included) with a polling fallback, a missing file meaning all off, and a
// bad document leaving the switch in force. While it runs the file is the
// switch's source of truth: a change made through the API lasts until the
// file changes next. cfg.OnChange, if set, is called before the manager
// applies each switch.
func SwitchFile(cfg trace.SwitchWatcherConfig) SwitchSource { return switchFile{cfg} }

type switchFile struct{ cfg trace.SwitchWatcherConfig }

func (s switchFile) Watch(ctx context.Context, set func(trace.Switch)) error {
	cfg := s.cfg
	prev := cfg.OnChange
	cfg.OnChange = func(sw trace.Switch) {
		if prev != nil {
			prev(sw)
		}
		set(sw)
	}
	w, err := trace.NewSwitchWatcher(cfg)
	if err != nil {
		return err
	}
	defer w.Close()
	return w.Run(ctx)
}
