package taskd

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"google.golang.org/grpc"
	grpccodes "google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/faultline-ml/faultline/internal/atomicfile"
	pb "github.com/faultline-ml/faultline/internal/taskdpb"
	"github.com/faultline-ml/faultline/topology"
)

// ErrBadCollect is wrapped by errors of Collect that come from its request
// or configuration rather than from a node.
var ErrBadCollect = errors.New("taskd: bad collection request")

// Collected kinds: the first element of every collected path.
const (
	CollectDotting = "dotting" // <DottingRoot>/<job>/... of the node
	CollectStacks  = "stacks"  // <StackRoot>/<job>/... of the node
)

// HostMappingFile is the name of the anonymisation file written beside the
// collected nodes, in topology.HostMapping's format.
const HostMappingFile = "host_ips_mapping.txt"

// collectChunk is the most file data one upload message carries; less when
// MaxMessageBytes is below twice that.
const collectChunk = 256 << 10

// CollectOptions selects what Collect fetches.
type CollectOptions struct {
	// Nodes to collect from; nil means every node with a live proxy.
	Nodes []int
	// Dotting and Stacks select the kinds; both false means both.
	Dotting, Stacks bool
}

// CollectResult is what one node shipped.
type CollectResult struct {
	Collection uint64
	Node       int
	Files      int
	Bytes      int64
	// Errors lists the files or steps that failed; the files shipped are
	// kept, and a later Collect resumes a file where it stopped.
	Errors []string
}

type collection struct {
	id      uint64
	waiting map[int]bool
	results map[int]CollectResult
	done    chan struct{}
	bytes   int64
}

// Collect asks the proxies of the selected nodes to ship their dotting and
// stack files for this job, and waits until each reported or ctx ends.
// Files land in <CollectDir>/<job>/node-<n>/<kind>/<path>, and
// host_ips_mapping.txt beside them numbers each node's host address (node
// n is number n+1): the collected tree itself names no host address. A transfer cut short
// resumes at the next Collect.
func (m *Manager) Collect(ctx context.Context, opts CollectOptions) ([]CollectResult, error) {
	if m.cfg.CollectDir == "" {
		return nil, fmt.Errorf("%w: ManagerConfig.CollectDir is not set", ErrBadCollect)
	}
	if !opts.Dotting && !opts.Stacks {
		opts.Dotting, opts.Stacks = true, true
	}
	m.collectMu.Lock()
	defer m.collectMu.Unlock()
	ctx, span := m.tracer.Start(ctx, "taskd.collect")
	defer span.End()
	id := m.nextID.Add(1)
	c := &collection{id: id, waiting: make(map[int]bool), results: make(map[int]CollectResult), done: make(chan struct{})}
	env := &pb.Envelope{Id: id, Fence: m.token(), Body: &pb.Envelope_Collect{Collect: &pb.CollectRequest{Collection: id, Dotting: opts.Dotting, Stacks: opts.Stacks}}}
	m.mu.Lock()
	nodes := sortedUnique(opts.Nodes)
	if opts.Nodes == nil {
		for _, mm := range m.reg.list() {
			if mm.key.role == RoleProxy {
				nodes = append(nodes, mm.pos.Node)
			}
		}
	}
	for _, n := range nodes {
		pm, dl := m.reg.get(proxyKey(n)), m.downlinks[proxyKey(n)]
		if pm == nil || dl == nil || dl.instance != pm.instance {
			c.results[n] = CollectResult{Collection: id, Node: n, Errors: []string{ErrNotConnected.Error()}}
			continue
		}
		c.waiting[n] = true
		m.push(dl, env)
	}
	if len(c.waiting) == 0 {
		close(c.done)
	}
	m.collections[id] = c
	m.mu.Unlock()
	span.SetAttributes(attribute.Int64("taskd.collection", int64(id)), attribute.Int("taskd.nodes", len(nodes)))
	var err error
	select {
	case <-c.done:
	case <-ctx.Done():
		err = ctx.Err()
	case <-m.closed:
		err = ErrClosed
	}
	m.mu.Lock()
	delete(m.collections, id)
	for n := range c.waiting {
		c.results[n] = CollectResult{Collection: id, Node: n, Errors: []string{"no report before the deadline"}}
	}
	out := make([]CollectResult, 0, len(c.results))
	var total int64
	for _, r := range c.results {
		out = append(out, r)
		total += r.Bytes
	}
	hosts := make(map[int]string)
	for _, r := range out {
		if h := m.proxyHosts[r.Node]; h != "" {
			hosts[r.Node] = h
		}
	}
	m.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].Node < out[j].Node })
	if herr := m.writeHostMapping(hosts); herr != nil {
		err = errors.Join(err, herr)
	}
	span.SetAttributes(attribute.Int64("taskd.bytes", total))
	if err != nil {
		span.SetStatus(codes.Error, err.Error())
	}
	return out, err
}

func (m *Manager) collectDone(r *pb.CollectResult) {
	m.mu.Lock()
	defer m.mu.Unlock()
	c := m.collections[r.GetCollection()]
	n := int(r.GetNode())
	if c == nil || !c.waiting[n] {
		return
	}
	delete(c.waiting, n)
	c.results[n] = CollectResult{Collection: c.id, Node: n, Files: int(r.GetFiles()), Bytes: r.GetBytes(), Errors: r.GetErrors()}
	if len(c.waiting) == 0 {
		close(c.done)
	}
}

// activeCollectionLocked returns the collection in progress that waits for
// node, or nil: uploads nobody asked for are refused.
func (m *Manager) activeCollectionLocked(node int) *collection {
	for _, c := range m.collections {
		if c.waiting[node] {
			return c
		}
	}
	return nil
}

// cleanCollectPath checks a path a proxy sends: slash separated, relative,
// no "." or ".." element, under one of the collected kinds.
func cleanCollectPath(p string) error {
	switch {
	case len(p) == 0 || len(p) > 1024:
		return fmt.Errorf("path: length %d, want 1 to 1024", len(p))
	case strings.ContainsAny(p, "\\\x00"):
		return fmt.Errorf("path %q: backslash or NUL", p)
	case !fs.ValidPath(p) || p == ".":
		return fmt.Errorf("path %q: not a clean relative path", p)
	case strings.HasSuffix(p, ".partial"):
		return fmt.Errorf("path %q: reserved suffix", p)
	}
	kind, _, ok := strings.Cut(p, "/")
	if !ok || (kind != CollectDotting && kind != CollectStacks) {
		return fmt.Errorf("path %q: not under %s/ or %s/", p, CollectDotting, CollectStacks)
	}
	return nil
}

// jobRoot opens <CollectDir>/<job>, creating it.
func (m *Manager) jobRoot() (*os.Root, string, error) {
	dir := filepath.Join(m.cfg.CollectDir, m.cfg.Job)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, "", err
	}
	r, err := os.OpenRoot(dir)
	return r, dir, err
}

func (m *Manager) uploadOffsets(req *pb.UploadOffsetRequest) (*pb.UploadOffsetResponse, error) {
	if m.cfg.CollectDir == "" {
		return nil, status.Error(grpccodes.FailedPrecondition, "taskd: collection is off (no CollectDir)")
	}
	if len(req.GetPaths()) > 100000 {
		return nil, status.Errorf(grpccodes.InvalidArgument, "taskd: paths: %d, at most 100000", len(req.GetPaths()))
	}
	root, _, err := m.jobRoot()
	if err != nil {
		return nil, status.Errorf(grpccodes.Internal, "taskd: collect dir: %v", err)
	}
	defer root.Close()
	resp := &pb.UploadOffsetResponse{}
	for i, p := range req.GetPaths() {
		if err := cleanCollectPath(p); err != nil {
			return nil, status.Errorf(grpccodes.InvalidArgument, "taskd: paths[%d]: %v", i, err)
		}
		dest := nodeDir(int(req.GetNode())) + "/" + p
		var off int64
		var complete bool
		if fi, err := root.Lstat(dest); err == nil && fi.Mode().IsRegular() {
			off, complete = fi.Size(), true
		} else if fi, err := root.Lstat(dest + ".partial"); err == nil && fi.Mode().IsRegular() {
			off = fi.Size()
		}
		resp.Offsets = append(resp.Offsets, off)
		resp.Complete = append(resp.Complete, complete)
	}
	return resp, nil
}

func nodeDir(node int) string { return "node-" + strconv.Itoa(node) }

// uploadIdleTimeout ends an upload that sends nothing for that long.
const uploadIdleTimeout = 10 * time.Second

// receiveUpload takes in one file's chunks and appends them to its partial
// copy, which becomes the file when the last chunk is in. One upload of a
// path runs at a time; each chunk must come within the idle timeout and
// while the node's collection is in progress.
func (m *Manager) receiveUpload(stream grpc.ClientStreamingServer[pb.UploadChunk, pb.UploadResponse]) error {
	ctx := stream.Context()
	type received struct {
		chunk *pb.UploadChunk
		err   error
	}
	// Receiving runs beside, so that a silent sender is timed out; it
	// ends with the stream, which ends when this returns.
	next := make(chan received)
	go func() {
		for {
			c, err := stream.Recv()
			select {
			case next <- received{c, err}:
			case <-ctx.Done():
				return
			}
			if err != nil {
				return
			}
		}
	}()
	idle := time.NewTimer(m.uploadIdle)
	defer idle.Stop()
	recv := func() (*pb.UploadChunk, error) {
		idle.Reset(m.uploadIdle)
		select {
		case r := <-next:
			return r.chunk, r.err
		case <-idle.C:
			return nil, status.Errorf(grpccodes.DeadlineExceeded, "taskd: upload idle for %v", m.uploadIdle)
		case <-ctx.Done():
			return nil, status.FromContextError(ctx.Err()).Err()
		}
	}
	first, err := recv()
	if err != nil {
		return err
	}
	if first.GetJob() != m.cfg.Job {
		return status.Errorf(grpccodes.NotFound, "taskd: unknown job %q", first.GetJob())
	}
	if err := nodeProxy(ctx, first.GetNode()); err != nil {
		return err
	}
	if m.cfg.CollectDir == "" {
		return status.Error(grpccodes.FailedPrecondition, "taskd: collection is off (no CollectDir)")
	}
	node, path := int(first.GetNode()), first.GetPath()
	if err := cleanCollectPath(path); err != nil {
		return status.Errorf(grpccodes.InvalidArgument, "taskd: %v", err)
	}
	dest := nodeDir(node) + "/" + path
	m.mu.Lock()
	c := m.activeCollectionLocked(node)
	busy := m.uploading[dest]
	if c != nil && !busy {
		m.uploading[dest] = true
	}
	m.mu.Unlock()
	switch {
	case c == nil:
		return status.Errorf(grpccodes.FailedPrecondition, "taskd: no collection in progress for node %d", node)
	case busy:
		return status.Errorf(grpccodes.Aborted, "taskd: %s: another upload of it is in progress", dest)
	}
	defer func() {
		m.mu.Lock()
		delete(m.uploading, dest)
		m.mu.Unlock()
	}()
	root, rootDir, err := m.jobRoot()
	if err != nil {
		return status.Errorf(grpccodes.Internal, "taskd: collect dir: %v", err)
	}
	defer root.Close()
	partial := dest + ".partial"
	dir := filepath.Dir(filepath.FromSlash(dest))
	if err := root.MkdirAll(dir, 0o755); err != nil {
		return status.Errorf(grpccodes.Internal, "taskd: collect: %v", err)
	}
	off := first.GetOffset()
	if fi, err := root.Lstat(dest); err == nil {
		if !fi.Mode().IsRegular() {
			return status.Errorf(grpccodes.FailedPrecondition, "taskd: %s is not a regular file", dest)
		}
		if off == fi.Size() {
			// The source grew since it was collected: continue it.
			if err := root.Rename(dest, partial); err != nil {
				return status.Errorf(grpccodes.Internal, "taskd: collect: %v", err)
			}
		}
	}
	f, err := root.OpenFile(partial, os.O_WRONLY|os.O_CREATE, 0o644)
	if err != nil {
		return status.Errorf(grpccodes.Internal, "taskd: collect: %v", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return status.Errorf(grpccodes.Internal, "taskd: collect: %v", err)
	}
	switch {
	case off == 0 && fi.Size() != 0:
		if err := f.Truncate(0); err != nil {
			return status.Errorf(grpccodes.Internal, "taskd: collect: %v", err)
		}
	case off != fi.Size():
		return status.Errorf(grpccodes.FailedPrecondition, "taskd: %s: resume at %d, but %d bytes are held", dest, off, fi.Size())
	}
	if _, err := f.Seek(off, io.SeekStart); err != nil {
		return status.Errorf(grpccodes.Internal, "taskd: collect: %v", err)
	}
	size := off
	for chunk := first; ; {
		if chunk.GetPath() != path || chunk.GetNode() != first.GetNode() || chunk.GetOffset() != size {
			return status.Errorf(grpccodes.InvalidArgument, "taskd: chunk for %s at %d, want %s at %d", chunk.GetPath(), chunk.GetOffset(), path, size)
		}
		n := int64(len(chunk.GetData()))
		m.mu.Lock()
		ended := m.collections[c.id] != c || !c.waiting[node]
		over := c.bytes+n > m.cfg.MaxCollectBytes
		if !ended && !over {
			c.bytes += n
		}
		m.mu.Unlock()
		switch {
		case ended:
			return status.Errorf(grpccodes.FailedPrecondition, "taskd: collection %d of node %d ended: late data refused", c.id, node)
		case over:
			return status.Errorf(grpccodes.ResourceExhausted, "taskd: collection exceeds %d bytes", m.cfg.MaxCollectBytes)
		}
		if _, err := f.Write(chunk.GetData()); err != nil {
			return status.Errorf(grpccodes.Internal, "taskd: collect: %v", err)
		}
		size += n
		m.met.collected.Add(float64(n))
		if chunk.GetLast() {
			break
		}
		if chunk, err = recv(); err != nil {
			if errors.Is(err, io.EOF) {
				err = status.Error(grpccodes.InvalidArgument, "taskd: upload ended without its last chunk")
			}
			return err
		}
	}
	if err := f.Sync(); err != nil {
		return status.Errorf(grpccodes.Internal, "taskd: collect: %v", err)
	}
	if err := root.Rename(partial, dest); err != nil {
		return status.Errorf(grpccodes.Internal, "taskd: collect: %v", err)
	}
	if err := atomicfile.SyncDir(filepath.Join(rootDir, dir)); err != nil {
		return status.Errorf(grpccodes.Internal, "taskd: collect: %v", err)
	}
	return stream.SendAndClose(&pb.UploadResponse{Size: size})
}

// writeHostMapping merges the nodes' addresses into host_ips_mapping.txt
// (topology.HostMapping's format): node n's host gets number n+1, its
// files are under node-<n>. A host already listed keeps its number, so
// nodes that share a host (several proxies on one machine) share a line.
func (m *Manager) writeHostMapping(hosts map[int]string) error {
	if len(hosts) == 0 {
		return nil
	}
	name := filepath.Join(m.cfg.CollectDir, m.cfg.Job, HostMappingFile)
	var hm topology.HostMapping
	if data, err := os.ReadFile(name); err == nil {
		if hm, err = topology.ParseHostMapping(data); err != nil {
			m.log.Error("taskd: replacing a bad host mapping", "file", name, "err", err)
			hm = nil
		}
	}
	nodes := make([]int, 0, len(hosts))
	for n := range hosts {
		nodes = append(nodes, n)
	}
	sort.Ints(nodes)
	for _, n := range nodes {
		host, id := hosts[n], n+1
		if _, listed := hm.ID(host); listed {
			continue
		}
		hm = slices.DeleteFunc(hm, func(a topology.HostAlias) bool { return a.ID == id }) // the node moved
		hm = append(hm, topology.HostAlias{Host: host, ID: id})
	}
	sort.Slice(hm, func(i, j int) bool { return hm[i].ID < hm[j].ID })
	if err := hm.Validate(); err != nil {
		return fmt.Errorf("taskd: host mapping: %w", err)
	}
	if err := atomicfile.WriteFile(name, hm.Marshal(), 0o600); err != nil {
		return fmt.Errorf("taskd: host mapping: %w", err)
	}
	return nil
}

// collectFiles ships this proxy's files for one collection request.
func (p *Proxy) collectFiles(ctx context.Context, client pb.ControlClient, req *pb.CollectRequest) *pb.CollectResult {
	ctx, span := p.tracer.Start(ctx, "taskd.collect.ship")
	defer span.End()
	res := &pb.CollectResult{Job: p.cfg.Job, Collection: req.GetCollection(), Node: int32(p.cfg.Node)}
	type source struct{ kind, dir string }
	var sources []source
	if req.GetDotting() && p.cfg.DottingRoot != "" {
		sources = append(sources, source{CollectDotting, filepath.Join(p.cfg.DottingRoot, p.cfg.Job)})
	}
	if req.GetStacks() && p.cfg.StackRoot != "" {
		sources = append(sources, source{CollectStacks, filepath.Join(p.cfg.StackRoot, p.cfg.Job)})
	}
	for _, src := range sources {
		root, err := os.OpenRoot(src.dir)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			res.Errors = append(res.Errors, err.Error())
			continue
		}
		p.shipRoot(ctx, client, root, src.kind, res)
		root.Close()
	}
	span.SetAttributes(attribute.Int("taskd.files", int(res.Files)), attribute.Int64("taskd.bytes", res.Bytes))
	res.Errors = boundErrors(res.Errors)
	return res
}

// maxCollectErrors and maxCollectErrorBytes bound the errors a collection
// result lists, within the bound of a CollectDone message (methodLimits).
const (
	maxCollectErrors     = 100
	maxCollectErrorBytes = 1 << 10
)

// boundErrors returns the first maxCollectErrors of errs, each cut, and
// how many more there were.
func boundErrors(errs []string) []string {
	out := make([]string, 0, min(len(errs), maxCollectErrors+1))
	for _, e := range errs[:min(len(errs), maxCollectErrors)] {
		out = append(out, cut(e, maxCollectErrorBytes))
	}
	if n := len(errs) - maxCollectErrors; n > 0 {
		out = append(out, fmt.Sprintf("and %d more", n))
	}
	return out
}

// shipRoot ships the regular files under root, never following a symlink.
func (p *Proxy) shipRoot(ctx context.Context, client pb.ControlClient, root *os.Root, kind string, res *pb.CollectResult) {
	var files []string
	err := fs.WalkDir(root.FS(), ".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			res.Errors = append(res.Errors, fmt.Sprintf("%s/%s: %v", kind, path, err))
			return nil
		}
		if d.Type().IsRegular() && !strings.HasSuffix(path, ".partial") {
			files = append(files, path)
		}
		return nil
	})
	if err != nil {
		res.Errors = append(res.Errors, err.Error())
	}
	for start := 0; start < len(files); start += 1000 {
		batch := files[start:min(start+1000, len(files))]
		for _, f := range batch {
			if err := p.shipFile(ctx, client, root, kind, f, res); err != nil {
				res.Errors = append(res.Errors, fmt.Sprintf("%s/%s: %v", kind, f, err))
				if ctx.Err() != nil {
					return
				}
			}
		}
	}
}

// shipFile sends one file from where the manager's copy ends, retrying a
// broken transfer from the new end.
func (p *Proxy) shipFile(ctx context.Context, client pb.ControlClient, root *os.Root, kind, path string, res *pb.CollectResult) error {
	remote := kind + "/" + path
	var lastErr error
	for attempt := range 3 {
		if attempt > 0 {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(time.Duration(attempt) * 200 * time.Millisecond):
			}
		}
		offs, err := client.UploadOffsets(ctx, &pb.UploadOffsetRequest{Job: p.cfg.Job, Node: int32(p.cfg.Node), Paths: []string{remote}})
		if err != nil {
			lastErr = err
			continue
		}
		if len(offs.GetOffsets()) != 1 || len(offs.GetComplete()) != 1 {
			return fmt.Errorf("the manager answered %d offsets and %d completions for 1 path", len(offs.GetOffsets()), len(offs.GetComplete()))
		}
		n, err := p.sendFrom(ctx, client, root, path, remote, offs.GetOffsets()[0], offs.GetComplete()[0])
		res.Bytes += n
		if err == nil {
			res.Files++
			return nil
		}
		lastErr = err
		if st, ok := status.FromError(err); ok && (st.Code() == grpccodes.ResourceExhausted || st.Code() == grpccodes.InvalidArgument) {
			break
		}
	}
	return errors.New(statusMessage(lastErr))
}

func (p *Proxy) sendFrom(ctx context.Context, client pb.ControlClient, root *os.Root, path, remote string, off int64, complete bool) (int64, error) {
	f, err := root.OpenFile(path, os.O_RDONLY|syscallNoFollow, 0)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return 0, err
	}
	if !fi.Mode().IsRegular() {
		return 0, fmt.Errorf("not a regular file")
	}
	size := fi.Size()
	if off > size {
		off = 0 // the file was replaced by a shorter one: start again
	}
	if off == size && complete {
		return 0, nil
	}
	if _, err := f.Seek(off, io.SeekStart); err != nil {
		return 0, err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := client.Upload(ctx)
	if err != nil {
		return 0, err
	}
	var sent int64
	for pos := off; ; {
		// A fresh buffer per chunk: gRPC may hold a sent message.
		buf := make([]byte, min(int64(collectChunk), int64(p.cfg.MaxMessageBytes/2), size-pos))
		n, err := io.ReadFull(f, buf)
		if err != nil {
			return sent, err
		}
		last := pos+int64(n) >= size
		if err := stream.Send(&pb.UploadChunk{Job: p.cfg.Job, Node: int32(p.cfg.Node), Path: remote, Offset: pos, Data: buf, Last: last}); err != nil {
			_, err = stream.CloseAndRecv()
			return sent, err
		}
		pos += int64(n)
		sent += int64(n)
		p.met.collected.Add(float64(n))
		if last {
			break
		}
	}
	_, err = stream.CloseAndRecv()
	return sent, err
}

func jsonString(s string) ([]byte, error) { return json.Marshal(s) }

func quote(s string) string { return strconv.Quote(s) }
