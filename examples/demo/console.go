package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// console prints the demo's story. On a terminal it keeps a live status
// line at the bottom, which each printed line moves down; elsewhere it
// prints lines only.
type console struct {
	mu     sync.Mutex
	w      io.Writer
	live   bool
	status func() string
	shown  bool
}

// isTerminal reports whether w is a terminal.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}

func newConsole(w io.Writer, status func() string) *console {
	return &console{w: w, live: isTerminal(w), status: status}
}

// printf prints a line (or lines) of the story.
func (c *console) printf(format string, args ...any) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.clearLocked()
	s := fmt.Sprintf(format, args...)
	if !strings.HasSuffix(s, "\n") {
		s += "\n"
	}
	io.WriteString(c.w, s)
	c.drawLocked()
}

func (c *console) clearLocked() {
	if c.live && c.shown {
		io.WriteString(c.w, "\r\x1b[2K")
		c.shown = false
	}
}

func (c *console) drawLocked() {
	if !c.live {
		return
	}
	s := c.status()
	if s == "" {
		return
	}
	io.WriteString(c.w, "\x1b[2m"+s+"\x1b[0m")
	c.shown = true
}

// run redraws the status line until ctx ends, then clears it.
func (c *console) run(ctx context.Context) {
	if !c.live {
		return
	}
	t := time.NewTicker(250 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			c.mu.Lock()
			c.clearLocked()
			c.mu.Unlock()
			return
		case <-t.C:
		}
		c.mu.Lock()
		c.clearLocked()
		c.drawLocked()
		c.mu.Unlock()
	}
}
