package agent

// Temporary consumer of the dotting ring, until the real one lands.

import (
	"encoding/binary"
	"fmt"
	"os"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

type ringRec struct {
	typ    uint8
	domain uint8
	time   uint64
	id     uint64
	tid    uint32
	aux    uint32
	name   []byte
}

const (
	recPad = iota
	recStart
	recEnd
	recMark
	recCollStart
	recCollEnd
	recCollError
)

type tmpRing struct {
	mem  []byte
	data []byte
	cap  uint64
}

func createRing(path string, capacity int) (*tmpRing, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	size := 4096 + capacity
	if err := f.Truncate(int64(size)); err != nil {
		return nil, err
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, err
	}
	copy(mem, "FLTRING\x00")
	binary.LittleEndian.PutUint32(mem[8:], 1)
	binary.LittleEndian.PutUint32(mem[12:], 4096)
	binary.LittleEndian.PutUint64(mem[16:], uint64(capacity))
	binary.LittleEndian.PutUint32(mem[28:], 1)
	return &tmpRing{mem: mem, data: mem[4096:], cap: uint64(capacity)}, nil
}

func (r *tmpRing) word64(off int) *uint64 { return (*uint64)(unsafe.Pointer(&r.mem[off])) }
func (r *tmpRing) word32(off int) *uint32 { return (*uint32)(unsafe.Pointer(&r.mem[off])) }

func (r *tmpRing) setSwitch(bits uint32) { atomic.StoreUint32(r.word32(24), bits) }
func (r *tmpRing) dropped() uint64       { return atomic.LoadUint64(r.word64(32)) }

func (r *tmpRing) drain(fn func(*ringRec)) error {
	w := atomic.LoadUint64(r.word64(64))
	rd := atomic.LoadUint64(r.word64(128))
	var rec ringRec
	for rd < w {
		off := rd % r.cap
		if off+8 > r.cap {
			return fmt.Errorf("ring: record at %d crosses the end", rd)
		}
		n := uint64(binary.LittleEndian.Uint32(r.data[off:]))
		typ := r.data[off+4]
		if n < 8 || n%8 != 0 || off+n > r.cap || rd+n > w {
			return fmt.Errorf("ring: bad record length %d at %d", n, rd)
		}
		if typ != recPad {
			if n < 32 {
				return fmt.Errorf("ring: record of %d bytes at %d", n, rd)
			}
			b := r.data[off : off+n]
			nl := uint64(binary.LittleEndian.Uint16(b[6:]))
			if 32+nl > n {
				return fmt.Errorf("ring: name of %d bytes in a record of %d at %d", nl, n, rd)
			}
			rec = ringRec{typ: typ, domain: b[5], time: binary.LittleEndian.Uint64(b[8:]), id: binary.LittleEndian.Uint64(b[16:]),
				tid: binary.LittleEndian.Uint32(b[24:]), aux: binary.LittleEndian.Uint32(b[28:]), name: b[32 : 32+nl]}
			fn(&rec)
		}
		rd += n
	}
	atomic.StoreUint64(r.word64(128), rd)
	return nil
}

func (r *tmpRing) close() error { return unix.Munmap(r.mem) }
