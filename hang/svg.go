package hang

import (
	"bufio"
	"encoding/xml"
	"hash/fnv"
	"io"
	"strconv"
	"strings"
	"unicode/utf8"
)

// Flame-graph geometry, in pixels.
const (
	svgWidth     = 1200.0
	svgPad       = 10.0
	svgFrameH    = 16.0
	svgTop       = 56.0
	svgBottom    = 12.0
	svgFontSize  = 11.0
	svgCharWidth = 6.6  // of the monospace font at svgFontSize
	svgMinWidth  = 0.25 // narrower frames (and what they call) are not drawn
)

// WriteSVG draws the tree of kind k as a self-contained flame graph: no
// script, no external reference. The outermost frames (process states)
// are at the bottom; a frame's width is its Weight; hovering a frame shows
// its full label and counts. Frames where some ranks leave the path their
// parent's ranks share are outlined in red: that is where ranks split.
// The output is a function of m alone, so it can be compared byte for byte.
func (m *Merged) WriteSVG(w io.Writer, k Kind) error {
	bw := bufio.NewWriter(w)
	root := m.Trees[k]
	depth := 0
	if root != nil {
		walk(root, func(path []*Node) { depth = max(depth, len(path)) })
	}
	height := svgTop + float64(max(depth, 1))*svgFrameH + svgBottom

	bw.WriteString(`<?xml version="1.0" encoding="UTF-8" standalone="no"?>` + "\n")
	bw.WriteString(`<svg xmlns="http://www.w3.org/2000/svg" version="1.1" width="` + fmtPx(svgWidth) + `" height="` + fmtPx(height) + `" viewBox="0 0 ` + fmtPx(svgWidth) + " " + fmtPx(height) + `">` + "\n")
	bw.WriteString(`<style>text{font-family:monospace;font-size:` + fmtPx(svgFontSize) + `px;fill:#000}.t{font-size:16px}.s{fill:#444}g.f:hover rect{stroke:#000;stroke-width:1}rect.split{stroke:#c00;stroke-width:1.5}</style>` + "\n")
	bw.WriteString(`<rect x="0" y="0" width="100%" height="100%" fill="#f8f8f4"/>` + "\n")

	title := kindTitle(k) + " stacks"
	sub := "world " + strconv.Itoa(m.World) + " · stacks from " + rankText(m.Trees[k].stuckOrEmpty()) +
		" · missing " + rankText(m.Missing) + " · width: ranks per stack · label: func@file@stuck|leak"
	writeText(bw, svgWidth/2, 24, "t", "middle", title)
	writeText(bw, svgWidth/2, 42, "s", "middle", sub)

	if root == nil || root.weight == 0 {
		writeText(bw, svgWidth/2, svgTop+svgFrameH, "s", "middle", "no "+string(k)+" stacks")
		bw.WriteString("</svg>\n")
		return bw.Flush()
	}

	scale := (svgWidth - 2*svgPad) / float64(root.weight)
	type item struct {
		n      *Node
		parent *Node
		x      float64
		depth  int
	}
	var stack []item
	push := func(parent *Node, x float64, depth int) {
		// Push right to left so that frames are drawn left to right.
		xs := make([]float64, len(parent.Children))
		for i, c := range parent.Children {
			xs[i] = x
			x += float64(c.weight) * scale
		}
		for i := len(parent.Children) - 1; i >= 0; i-- {
			stack = append(stack, item{parent.Children[i], parent, xs[i], depth})
		}
	}
	push(root, svgPad, 0)
	for len(stack) > 0 {
		it := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		n := it.n
		wpx := float64(n.weight) * scale
		if wpx < svgMinWidth {
			continue
		}
		y := height - svgBottom - float64(it.depth+1)*svgFrameH
		label := cleanLabel(m.Label(n), false)
		split := !n.isState && it.parent != root && !n.Stuck.Equal(it.parent.Stuck)

		bw.WriteString(`<g class="f"><title>`)
		xml.EscapeText(bw, []byte(label))
		bw.WriteString("\nstuck here: " + strconv.Itoa(n.Stuck.Len()) + " of " + strconv.Itoa(m.World) + " ranks; width " + strconv.Itoa(n.weight))
		if !n.Ends.IsEmpty() {
			bw.WriteString("; innermost frame of ranks " + rankText(n.Ends))
		}
		bw.WriteString(`</title><rect x="` + fmtPx(it.x) + `" y="` + fmtPx(y) + `" width="` + fmtPx(wpx) + `" height="` + fmtPx(svgFrameH-1) + `" rx="2" ry="2" fill="` + frameColor(k, n) + `"`)
		if split {
			bw.WriteString(` class="split"`)
		}
		bw.WriteString("/>")
		if text := fitText(label, wpx); text != "" {
			bw.WriteString(`<text x="` + fmtPx(it.x+3) + `" y="` + fmtPx(y+svgFrameH-4.5) + `">`)
			xml.EscapeText(bw, []byte(text))
			bw.WriteString("</text>")
		}
		bw.WriteString("</g>\n")
		push(n, it.x, it.depth+1)
	}
	bw.WriteString("</svg>\n")
	return bw.Flush()
}

func (n *Node) stuckOrEmpty() Ranks {
	if n == nil {
		return Ranks{}
	}
	return n.Stuck
}

func rankText(r Ranks) string {
	if r.IsEmpty() {
		return "none"
	}
	return r.String()
}

func kindTitle(k Kind) string {
	switch k {
	case KindPython:
		return "Python"
	case KindNative:
		return "Native"
	case KindGo:
		return "Go"
	}
	return string(k)
}

func writeText(bw *bufio.Writer, x, y float64, class, anchor, s string) {
	bw.WriteString(`<text x="` + fmtPx(x) + `" y="` + fmtPx(y) + `" class="` + class + `" text-anchor="` + anchor + `">`)
	xml.EscapeText(bw, []byte(cleanLabel(s, false)))
	bw.WriteString("</text>\n")
}

func fmtPx(v float64) string { return strconv.FormatFloat(v, 'f', 2, 64) }

// fitText returns s cut to what fits in a frame wpx wide, or "" when not
// even three characters fit.
func fitText(s string, wpx float64) string {
	fit := int((wpx - 6) / svgCharWidth)
	if fit < 3 {
		return ""
	}
	if utf8.RuneCountInString(s) <= fit {
		return s
	}
	n := 0
	for i := range s {
		if n == fit-2 {
			return s[:i] + ".."
		}
		n++
	}
	return s
}

// frameColor picks a colour from the frame's family (as xpu_timer's viewer
// does: Python cyan, framework green, C/system red, C++ yellow, state
// purple) with a shade from a hash of the function name, so that equal
// names get equal colours in every graph.
func frameColor(k Kind, n *Node) string {
	h := fnv.New32a()
	h.Write([]byte(n.Frame.Func))
	v := float64(h.Sum32()%1000) / 1000
	f := n.Frame
	lower := strings.ToLower(f.File + " " + f.Func)
	var r, g, b float64
	switch {
	case n.isState:
		r, g, b = 180+v*30, 140+v*30, 230
	case strings.HasPrefix(f.Func, "[... "):
		r, g, b = 190, 190, 190
	case strings.Contains(lower, "torch") || strings.Contains(lower, "nccl") || strings.Contains(lower, "hccl") || strings.Contains(lower, "c10"):
		r, g, b = 50+v*60, 190+v*55, 50+v*60
	case k == KindPython:
		r, g, b = 50+v*60, 170+v*55, 190+v*55
	case k == KindGo && strings.HasPrefix(f.Func, "runtime."):
		r, g, b = 210+v*40, 90+v*70, 80+v*50
	case k == KindGo:
		r, g, b = 80+v*60, 150+v*60, 225+v*30
	case strings.Contains(lower, "libc.") || strings.Contains(lower, "libpthread") || strings.Contains(lower, "ld-linux") ||
		strings.Contains(lower, "/sysdeps/") || strings.Contains(lower, "nptl") || strings.HasPrefix(f.Func, "__"):
		r, g, b = 205+v*50, 60+v*80, 60+v*60
	case strings.Contains(f.Func, "::"):
		r, g, b = 195+v*55, 185+v*55, 50+v*40
	default:
		r, g, b = 230+v*25, 130+v*70, 40+v*40
	}
	return "rgb(" + strconv.Itoa(int(r)) + "," + strconv.Itoa(int(g)) + "," + strconv.Itoa(int(b)) + ")"
}
