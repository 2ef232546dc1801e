package hang

import (
	"bufio"
	"io"
	"strconv"
	"unicode/utf8"
)

// WriteFolded writes the tree of kind k as folded stacks (Brendan Gregg's
// format, one line per distinct stack, outermost frame first):
//
//	State@S (sleeping);main@train.py:9@0-7|;step@train.py:42@0-5/7|6 7
//
// Frames are labelled as Label does; a line's count is the number of
// ranks whose thread has exactly that stack. A kind without a tree
// writes nothing.
func (m *Merged) WriteFolded(w io.Writer, k Kind) error {
	root := m.Trees[k]
	if root == nil {
		return nil
	}
	bw := bufio.NewWriter(w)
	labels := map[*Node]string{}
	var line []byte
	walk(root, func(path []*Node) {
		n := path[len(path)-1]
		labels[n] = cleanLabel(m.Label(n), true)
		if n.Ends.isEmpty() {
			return
		}
		line = line[:0]
		for i, p := range path {
			if i > 0 {
				line = append(line, ';')
			}
			line = append(line, labels[p]...)
		}
		line = append(line, ' ')
		line = strconv.AppendInt(line, int64(n.Ends.Len()), 10)
		line = append(line, '\n')
		bw.Write(line)
	})
	return bw.Flush()
}

// cleanLabel makes a label safe for a line-oriented text format: control
// characters become spaces, bytes that are not UTF-8 become \xNN and, for
// folded stacks, the frame separator ';' becomes ':'.
func cleanLabel(s string, folded bool) string {
	clean := true
	for i := 0; i < len(s); {
		c := s[i]
		if c < 0x20 || c == 0x7f || folded && c == ';' {
			clean = false
			break
		}
		if c < utf8.RuneSelf {
			i++
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			clean = false
			break
		}
		i += size
	}
	if clean {
		return s
	}
	b := make([]byte, 0, len(s)+8)
	for i := 0; i < len(s); {
		c := s[i]
		switch {
		case c < 0x20 || c == 0x7f:
			b = append(b, ' ')
			i++
		case folded && c == ';':
			b = append(b, ':')
			i++
		case c < utf8.RuneSelf:
			b = append(b, c)
			i++
		default:
			r, size := utf8.DecodeRuneInString(s[i:])
			if r == utf8.RuneError && size == 1 {
				const hex = "0123456789abcdef"
				b = append(b, '\\', 'x', hex[c>>4], hex[c&15])
			} else {
				b = append(b, s[i:i+size]...)
			}
			i += size
		}
	}
	return string(b)
}
