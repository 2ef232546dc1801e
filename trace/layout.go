package trace

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Defaults of the on-disk layout, as MindCluster uses them.
const (
	// DefaultRoot is the folder that holds one folder per job.
	DefaultRoot = "/user/cluster-info/profiling"
	// DefaultSwitchPath is where a Kubernetes ConfigMap mounts the switch.
	DefaultSwitchPath = "/user/cluster-info/datatrace-config/profilingSwitch"
	// EnvTaskID names the environment variable that holds the job id.
	EnvTaskID = "MINDX_TASK_ID"
	// DefaultJobPrefix starts the name of a job folder chosen when
	// MINDX_TASK_ID is unset; unix seconds follow it.
	DefaultJobPrefix = "default_task_id_"
	// ParallelGroupFile is the name of the communicator map in a rank folder.
	ParallelGroupFile = "parallel_group.json"

	// jobClaimDir holds, under the root, one claim file per launcher that
	// started processes without a job id (see ResolveJob).
	jobClaimDir = ".faultline-jobs"

	dirMode  = 0o750
	fileMode = 0o640
)

// ErrPath is wrapped by every error about a job id, rank or path that
// must not be used: traversal, a symlink where a folder should be, a name
// that is not one path element.
var ErrPath = errors.New("trace: unsafe path")

// ValidateJob reports whether job can name a job folder: one path element
// of at most 255 bytes, not starting with a dot, with no slash, NUL or
// control character. "../../etc" is refused.
func ValidateJob(job string) error {
	bad := func(why string) error {
		return fmt.Errorf("%w: job id %q: %s", ErrPath, job, why)
	}
	switch {
	case job == "":
		return bad("empty")
	case len(job) > 255:
		return bad("longer than 255 bytes")
	case job[0] == '.':
		return bad("starts with a dot")
	}
	for i := 0; i < len(job); i++ {
		if c := job[i]; c == '/' || c == '\\' || c < 0x20 || c == 0x7f {
			return bad(fmt.Sprintf("byte %#x at %d is not allowed", c, i))
		}
	}
	return nil
}

// IsRecordFileName reports whether name is a record file's name: 1 to 20
// ASCII digits (the writer uses 10: unix seconds).
func IsRecordFileName(name string) bool {
	if len(name) == 0 || len(name) > 20 {
		return false
	}
	for i := 0; i < len(name); i++ {
		if name[i] < '0' || name[i] > '9' {
			return false
		}
	}
	return true
}

// RecordFileName returns the name of a record file created at t: its unix
// seconds in 10 digits.
func RecordFileName(t time.Time) string {
	return fmt.Sprintf("%010d", t.Unix())
}

// recordNameLess orders record file names numerically.
func recordNameLess(a, b string) bool {
	a, b = strings.TrimLeft(a, "0"), strings.TrimLeft(b, "0")
	if len(a) != len(b) {
		return len(a) < len(b)
	}
	return a < b
}

func recordNameCmp(a, b string) int {
	switch {
	case recordNameLess(a, b):
		return -1
	case recordNameLess(b, a):
		return 1
	}
	return strings.Compare(a, b)
}

// parseRankName returns the rank a folder name stands for: a decimal
// number in canonical form ("7", not "007").
func parseRankName(name string) (int, bool) {
	if !IsRecordFileName(name) || len(name) > 9 {
		return 0, false
	}
	n, err := strconv.Atoi(name)
	return n, err == nil && strconv.Itoa(n) == name
}

// ResolveJob returns the job folder name for a process writing under root:
//
//  1. $MINDX_TASK_ID when set (it must pass ValidateJob);
//  2. otherwise "default_task_id_<unix seconds>", chosen once per launcher:
//     the first process of a launcher (the process that started this one:
//     torchrun's agent, mpirun's orted, slurmstepd, a shell script) to get
//     here creates the job folder and publishes its name in a claim file
//     root/.faultline-jobs/<host>-<parent pid>-<parent start time>, linked in
//     with exclusive-create semantics; every later process of that launcher
//     on this node reads the claim and uses the same folder.
//
// Processes on different nodes cannot share a claim: a launcher that spans
// nodes and has no task id sets MINDX_TASK_ID itself (for instance to
// default_task_id_<its start seconds>) so that all ranks agree.
func ResolveJob(root string) (string, error) {
	if job, ok := os.LookupEnv(EnvTaskID); ok && job != "" {
		if err := ValidateJob(job); err != nil {
			return "", fmt.Errorf("trace: $%s: %w", EnvTaskID, err)
		}
		return job, nil
	}
	key, err := launcherKey()
	if err != nil {
		return "", err
	}
	return claimJob(root, key, time.Now)
}

// launcherKey names this process's parent incarnation: host, parent pid
// and the parent's start time in clock ticks since boot, so that a reused
// pid is a different launcher.
func launcherKey() (string, error) {
	host, _ := os.Hostname()
	if ValidateJob(host) != nil {
		host = "host"
	}
	ppid := os.Getppid()
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", ppid))
	if err != nil {
		return "", fmt.Errorf("trace: identify the launcher: %w", err)
	}
	start, err := procStartTime(stat)
	if err != nil {
		return "", fmt.Errorf("trace: /proc/%d/stat: %w", ppid, err)
	}
	return fmt.Sprintf("%s-%d-%d", host, ppid, start), nil
}

// procStartTime returns field 22 (starttime) of a /proc/<pid>/stat line.
// The command name (field 2) may hold spaces and parentheses, so fields
// are counted after its last ')'.
func procStartTime(stat []byte) (uint64, error) {
	i := bytes.LastIndexByte(stat, ')')
	if i < 0 {
		return 0, errors.New("no command name")
	}
	f := strings.Fields(string(stat[i+1:]))
	const idx = 22 - 3 // fields after ")" start at field 3
	if len(f) <= idx {
		return 0, fmt.Errorf("%d fields, want at least 22", len(f)+2)
	}
	return strconv.ParseUint(f[idx], 10, 64)
}

// claimJob implements the once-per-launcher choice of ResolveJob.
func claimJob(root, key string, now func() time.Time) (string, error) {
	rootfd, err := openRoot(root, true)
	if err != nil {
		return "", err
	}
	defer unix.Close(rootfd)
	cfd, err := mkdirOpenAt(rootfd, root, jobClaimDir)
	if err != nil {
		return "", err
	}
	defer unix.Close(cfd)
	claimPath := filepath.Join(root, jobClaimDir, key)
	if job, err := readClaim(cfd, key); err == nil {
		return job, nil
	} else if !errors.Is(err, unix.ENOENT) {
		return "", fmt.Errorf("trace: read job claim %s: %w", claimPath, err)
	}
	// Create a job folder of our own, a fresh name even if another
	// launcher picked the same second.
	var job string
	for sec := now().Unix(); ; sec++ {
		job = DefaultJobPrefix + strconv.FormatInt(sec, 10)
		err := unix.Mkdirat(rootfd, job, dirMode)
		if err == nil {
			unix.Fchmodat(rootfd, job, dirMode, 0)
			break
		}
		if !errors.Is(err, unix.EEXIST) {
			return "", fmt.Errorf("trace: create job folder %s: %w", filepath.Join(root, job), err)
		}
	}
	// Publish it: write a temporary file, then link it under the claim name,
	// which fails if another process of this launcher got there first.
	tmp := fmt.Sprintf(".%s.tmp-%d", key, os.Getpid())
	fd, err := unix.Openat(cfd, tmp, unix.O_WRONLY|unix.O_CREAT|unix.O_TRUNC|unix.O_NOFOLLOW|unix.O_CLOEXEC, fileMode)
	if err != nil {
		unix.Unlinkat(rootfd, job, unix.AT_REMOVEDIR)
		return "", fmt.Errorf("trace: write job claim %s: %w", claimPath, err)
	}
	f := os.NewFile(uintptr(fd), tmp)
	_, err = f.WriteString(job + "\n")
	if err == nil {
		err = f.Sync()
	}
	f.Close()
	if err == nil {
		err = unix.Linkat(cfd, tmp, cfd, key, 0)
	}
	unix.Unlinkat(cfd, tmp, 0)
	switch {
	case err == nil:
		unix.Fsync(cfd)
		return job, nil
	case errors.Is(err, unix.EEXIST):
		unix.Unlinkat(rootfd, job, unix.AT_REMOVEDIR) // still empty: nobody else knows its name
		if job, err := readClaim(cfd, key); err == nil {
			return job, nil
		} else {
			return "", fmt.Errorf("trace: read job claim %s: %w", claimPath, err)
		}
	default:
		unix.Unlinkat(rootfd, job, unix.AT_REMOVEDIR)
		return "", fmt.Errorf("trace: write job claim %s: %w", claimPath, err)
	}
}

func readClaim(dirfd int, name string) (string, error) {
	fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", err
	}
	f := os.NewFile(uintptr(fd), name)
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, 512))
	if err != nil {
		return "", err
	}
	job := strings.TrimSpace(string(b))
	if err := ValidateJob(job); err != nil {
		return "", err
	}
	return job, nil
}

// openRoot opens the root folder, creating it (and its parents) when
// create is set. The root is trusted as configured: it may be a mount
// point or a symlink. Nothing beneath it is ever followed.
func openRoot(root string, create bool) (int, error) {
	if create {
		if err := os.MkdirAll(root, dirMode); err != nil {
			return -1, fmt.Errorf("trace: create root %s: %w", root, err)
		}
	}
	fd, err := unix.Open(root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("trace: open root %s: %w", root, &os.PathError{Op: "open", Path: root, Err: err})
	}
	return fd, nil
}

// openDirAt opens the folder name under dirfd without following a symlink.
// dirPath names dirfd in errors.
func openDirAt(dirfd int, dirPath, name string) (int, error) {
	fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		p := filepath.Join(dirPath, name)
		if errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOTDIR) {
			return -1, fmt.Errorf("%w: %s is not a folder (a symlink or a file)", ErrPath, p)
		}
		return -1, &os.PathError{Op: "open", Path: p, Err: err}
	}
	return fd, nil
}

// mkdirOpenAt creates the folder name under dirfd with mode 0750 unless it
// exists, and opens it without following a symlink.
func mkdirOpenAt(dirfd int, dirPath, name string) (int, error) {
	err := unix.Mkdirat(dirfd, name, dirMode)
	if err == nil {
		// Exact mode regardless of the umask.
		unix.Fchmodat(dirfd, name, dirMode, 0)
	} else if !errors.Is(err, unix.EEXIST) {
		return -1, &os.PathError{Op: "mkdir", Path: filepath.Join(dirPath, name), Err: err}
	}
	return openDirAt(dirfd, dirPath, name)
}

// openRankDir opens (creating when asked) root/job/rank with no symlink
// followed beneath root.
func openRankDir(root, job string, rank int, create bool) (int, error) {
	if err := ValidateJob(job); err != nil {
		return -1, err
	}
	if rank < 0 {
		return -1, fmt.Errorf("%w: rank %d is negative", ErrPath, rank)
	}
	rootfd, err := openRoot(root, create)
	if err != nil {
		return -1, err
	}
	defer unix.Close(rootfd)
	open := openDirAt
	if create {
		open = mkdirOpenAt
	}
	jobfd, err := open(rootfd, root, job)
	if err != nil {
		return -1, err
	}
	defer unix.Close(jobfd)
	return open(jobfd, filepath.Join(root, job), strconv.Itoa(rank))
}

// listDir lists the folder open as dirfd without disturbing dirfd's offset.
func listDir(dirfd int, path string) ([]os.DirEntry, error) {
	fd, err := unix.Openat(dirfd, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	f := os.NewFile(uintptr(fd), path)
	defer f.Close()
	return f.ReadDir(-1)
}

// ListRanks returns the ranks that have a folder in jobDir, in increasing
// order. Entries that are not folders with a decimal name (symlinks
// included) are ignored.
func ListRanks(jobDir string) ([]int, error) {
	ents, err := os.ReadDir(jobDir)
	if err != nil {
		return nil, fmt.Errorf("trace: list ranks: %w", err)
	}
	var ranks []int
	for _, e := range ents {
		if !e.IsDir() { // a symlink's type is not a folder's
			continue
		}
		if r, ok := parseRankName(e.Name()); ok {
			ranks = append(ranks, r)
		}
	}
	slices.Sort(ranks)
	return ranks, nil
}

// ListJobs returns the job folders under root, sorted by name. Hidden
// entries, files and symlinks are ignored.
func ListJobs(root string) ([]string, error) {
	ents, err := os.ReadDir(root)
	if err != nil {
		return nil, fmt.Errorf("trace: list jobs: %w", err)
	}
	var jobs []string
	for _, e := range ents {
		if e.IsDir() && ValidateJob(e.Name()) == nil {
			jobs = append(jobs, e.Name())
		}
	}
	return jobs, nil
}

// openFileAt opens the regular file name under dirfd (the folder dirPath,
// named in errors) for reading; a symlink, a FIFO or a device is refused
// (O_NONBLOCK keeps a FIFO from blocking the open). It returns the bare
// descriptor and the file's size: a reader that opens thousands of files
// a pass spares the calls an *os.File costs. The descriptor stays
// non-blocking, which regular files ignore; its readers take EAGAIN for
// the end for now.
func openFileAt(dirfd int, dirPath, name string) (fd int, size int64, err error) {
	fd, err = unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		p := filepath.Join(dirPath, name)
		if errors.Is(err, unix.ELOOP) {
			return -1, 0, fmt.Errorf("%w: %s is a symlink", ErrPath, p)
		}
		return -1, 0, &os.PathError{Op: "open", Path: p, Err: err}
	}
	size, err = checkRegular(fd, func() string { return filepath.Join(dirPath, name) })
	if err != nil {
		unix.Close(fd)
		return -1, 0, err
	}
	return fd, size, nil
}

// regularFile makes fd, which names, an *os.File if it is a regular file,
// and closes it otherwise.
func regularFile(fd int, name string) (*os.File, error) {
	if _, err := checkRegular(fd, func() string { return name }); err != nil {
		unix.Close(fd)
		return nil, err
	}
	// Back to blocking reads; regular files never block anyway.
	unix.SetNonblock(fd, false)
	return os.NewFile(uintptr(fd), name), nil
}

// checkRegular returns the size of the file fd, or an error naming it if
// it is not a regular file.
func checkRegular(fd int, name func() string) (int64, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return 0, &os.PathError{Op: "stat", Path: name(), Err: err}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return 0, fmt.Errorf("%w: %s is not a regular file", ErrPath, name())
	}
	return st.Size, nil
}

// readFileAt reads the regular file name under dirfd, up to limit bytes:
// the caller refuses a file longer than it wants by asking for one byte
// more.
func readFileAt(dirfd int, dirPath, name string, limit int64) ([]byte, error) {
	fd, size, err := openFileAt(dirfd, dirPath, name)
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)
	// Room for one byte more than the size: a file that ends there takes
	// two reads, and one that grew since is seen to.
	b := make([]byte, 0, min(size+1, limit))
	for len(b) < int(limit) {
		if len(b) == cap(b) {
			b = slices.Grow(b, min(len(b), int(limit)-len(b)))
		}
		n, err := unix.Pread(fd, b[len(b):cap(b)], int64(len(b)))
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return nil, &os.PathError{Op: "read", Path: filepath.Join(dirPath, name), Err: err}
		}
		if n == 0 {
			break
		}
		b = b[:len(b)+n]
	}
	return b, nil
}
