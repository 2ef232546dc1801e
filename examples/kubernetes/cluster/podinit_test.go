package cluster_test

import (
	"cmp"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"go.uber.org/goleak"
	"golang.org/x/sys/unix"
)

// podInitEnv names the file of a podInit: the test binary started with
// it set is no test but a container's first process, which sets up the
// container's file system and execs its command.
const podInitEnv = "FAULTLINE_TEST_POD_INIT"

func TestMain(m *testing.M) {
	if f := os.Getenv(podInitEnv); f != "" {
		err := runPodInit(f)
		fmt.Fprintf(os.Stderr, "pod init: %v\n", err)
		os.Exit(127)
	}
	// The API server's test harness logs at verbosity 5 by default: the
	// failures' own messages would drown. -v=N on the command line still
	// sets it.
	flag.Set("v", "0")
	code := m.Run()
	if imageDir != "" {
		os.RemoveAll(imageDir)
	}
	if code == 0 {
		if err := goleak.Find(leakOptions...); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

var leakOptions = []goleak.Option{
	// The API server's watch cache leaves its waits for freshness to
	// their timeouts; ktesting, imported by the API server's test
	// harness, watches for signals from its init.
	goleak.IgnoreTopFunction("k8s.io/apiserver/pkg/storage/cacher.(*watchCache).waitUntilFreshAndBlock.func2"),
	goleak.IgnoreTopFunction("k8s.io/kubernetes/test/utils/ktesting.(*progressReporter).run"),
	goleak.IgnoreTopFunction("k8s.io/kubernetes/test/utils/ktesting.init.1.func1"),
	goleak.IgnoreTopFunction("os/signal.NotifyContext.func1"),
	// Its healthz log check starts a klog flusher it never stops
	// (created by healthz.(*log).Check.func1; this goleak cannot match on
	// the creator).
	goleak.IgnoreTopFunction("k8s.io/apimachinery/pkg/util/wait.BackoffUntilWithContext"),
}

// podInit is what a container's first process sets up before it execs
// the container's command.
type podInit struct {
	Root     string // where the container's root is made (a tmpfs)
	Work     string // the overlays' upper and work folders
	Image    string // the image's files, laid over the machine's
	Mounts   []podMount
	Hosts    string // bound on /etc/hosts
	Resolv   string // /etc/resolv.conf's text
	Hostname string
	Dir      string // the working folder
	Argv     []string
	Env      []string
	UID, GID int // -1: root's
	Groups   []int
}

// podMount is one volume mount of the container.
type podMount struct {
	Source   string // "" for a tmpfs
	Target   string
	ReadOnly bool
	Size     string // the tmpfs's size= option
}

// runPodInit makes the container's root, a view of this machine's with
// the image's files over it, a private /tmp, the pod's volumes at their
// mount paths and the pod's /etc/hosts, then becomes the container's
// user and execs its command there. It runs in a mount and a network
// namespace of the pod's own; it returns only on failure.
func runPodInit(file string) error {
	b, err := os.ReadFile(file)
	if err != nil {
		return err
	}
	var p podInit
	if err := json.Unmarshal(b, &p); err != nil {
		return fmt.Errorf("%s: %w", file, err)
	}
	if err := unix.Sethostname([]byte(p.Hostname)); err != nil {
		return fmt.Errorf("hostname: %w", err)
	}
	if err := unix.Mount("tmpfs", p.Root, "tmpfs", 0, "mode=755"); err != nil {
		return fmt.Errorf("root tmpfs: %w", err)
	}
	// The top folders written into (mount points made, files replaced)
	// are overlays, so that nothing is written into the machine's own.
	overlay := map[string]bool{"etc": true}
	for i := range p.Mounts {
		m := &p.Mounts[i]
		m.Target = resolve(m.Target)
		overlay[strings.Split(strings.TrimPrefix(m.Target, "/"), "/")[0]] = true
	}
	imageTops := map[string]bool{}
	if p.Image != "" {
		es, _ := os.ReadDir(p.Image)
		for _, e := range es {
			imageTops[e.Name()] = true
			overlay[e.Name()] = true
		}
	}
	tops, err := os.ReadDir("/")
	if err != nil {
		return err
	}
	seen := map[string]bool{}
	for _, e := range tops {
		name, dst := e.Name(), filepath.Join(p.Root, e.Name())
		seen[name] = true
		switch {
		case e.Type()&os.ModeSymlink != 0:
			l, err := os.Readlink("/" + name)
			if err != nil {
				return err
			}
			if err := os.Symlink(l, dst); err != nil {
				return err
			}
		case !e.IsDir():
		case name == "tmp":
			if err := os.Mkdir(dst, 0o1777); err != nil {
				return err
			}
			os.Chmod(dst, 0o1777)
		case overlay[name]:
			lower := "/" + name
			if imageTops[name] {
				lower = filepath.Join(p.Image, name) + ":" + lower
			}
			if err := mountOverlay(dst, lower, filepath.Join(p.Work, name)); err != nil {
				return err
			}
		default:
			if err := bind("/"+name, dst, false); err != nil {
				return err
			}
		}
	}
	for name := range overlay {
		if seen[name] {
			continue
		}
		dst := filepath.Join(p.Root, name)
		if imageTops[name] {
			if err := mountOverlay(dst, filepath.Join(p.Image, name), filepath.Join(p.Work, name)); err != nil {
				return err
			}
		} else if err := os.Mkdir(dst, 0o755); err != nil {
			return err
		}
	}
	mounts := slices.Clone(p.Mounts)
	slices.SortFunc(mounts, func(a, b podMount) int { return len(a.Target) - len(b.Target) })
	for _, m := range mounts {
		dst := filepath.Join(p.Root, m.Target)
		if err := os.MkdirAll(dst, 0o755); err != nil {
			return err
		}
		if m.Source == "" {
			if err := unix.Mount("tmpfs", dst, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=1777,size="+m.Size); err != nil {
				return fmt.Errorf("tmpfs on %s: %w", m.Target, err)
			}
			continue
		}
		if err := bind(m.Source, dst, m.ReadOnly); err != nil {
			return err
		}
	}
	if err := bind(p.Hosts, filepath.Join(p.Root, "etc/hosts"), true); err != nil {
		return err
	}
	resolv := filepath.Join(p.Root, "etc/resolv.conf")
	os.Remove(resolv)
	if err := os.WriteFile(resolv, []byte(p.Resolv), 0o644); err != nil {
		return err
	}
	dir := filepath.Join(p.Root, p.Dir)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	if err := unix.Chroot(p.Root); err != nil {
		return fmt.Errorf("chroot: %w", err)
	}
	if err := os.Chdir(cmp.Or(p.Dir, "/")); err != nil {
		return err
	}
	for _, kv := range p.Env {
		if v, ok := strings.CutPrefix(kv, "PATH="); ok {
			os.Setenv("PATH", v)
		}
	}
	path, err := exec.LookPath(p.Argv[0])
	if err != nil {
		return err
	}
	if p.GID >= 0 {
		if err := syscall.Setgroups(p.Groups); err != nil {
			return err
		}
		if err := syscall.Setgid(p.GID); err != nil {
			return err
		}
	}
	if p.UID >= 0 {
		if err := syscall.Setuid(p.UID); err != nil {
			return err
		}
	}
	return syscall.Exec(path, p.Argv, p.Env)
}

// resolve follows the links on path's way, as this machine has them
// (the container's root is a view of it): a mount point made through
// /var/run, a link to /run, is made in the container's /run and not in
// this machine's.
func resolve(path string) string {
	parts := strings.Split(strings.Trim(filepath.Clean(path), "/"), "/")
	cur := "/"
	for i := 0; i < len(parts); i++ {
		next := filepath.Join(cur, parts[i])
		l, err := os.Readlink(next)
		if err != nil {
			cur = next
			continue
		}
		if !filepath.IsAbs(l) {
			l = filepath.Join(cur, l)
		}
		return resolve(filepath.Join(append([]string{l}, parts[i+1:]...)...))
	}
	return cur
}

func mountOverlay(dst, lower, work string) error {
	upper, wd := filepath.Join(work, "upper"), filepath.Join(work, "work")
	for _, d := range []string{dst, upper, wd} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	if err := unix.Mount("overlay", dst, "overlay", 0, "lowerdir="+lower+",upperdir="+upper+",workdir="+wd); err != nil {
		return fmt.Errorf("overlay of %s on %s: %w", lower, dst, err)
	}
	return nil
}

func bind(src, dst string, ro bool) error {
	if fi, err := os.Stat(src); err == nil && !fi.IsDir() {
		if _, err := os.Stat(dst); err != nil {
			if err := os.WriteFile(dst, nil, 0o644); err != nil {
				return err
			}
		}
	} else if err := os.MkdirAll(dst, 0o755); err != nil {
		return err
	}
	if err := unix.Mount(src, dst, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("bind %s on %s: %w", src, dst, err)
	}
	if ro {
		if err := unix.Mount("", dst, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY, ""); err != nil {
			return fmt.Errorf("read-only %s: %w", dst, err)
		}
	}
	return nil
}
