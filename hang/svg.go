package hang

import (
	"bufio"
	"encoding/xml"
	"hash/fnv"
	"io"
	"path"
	"strconv"
	"strings"
	"unicode/utf8"
)

// Flame-graph geometry, in pixels.
const (
	svgWidth     = 1200.0
	svgPad       = 10.0
	svgFrameH    = 16.0
	svgTop       = 74.0
	svgBottom    = 12.0
	svgFontSize  = 11.0
	svgCharWidth = 6.6  // of the monospace font at svgFontSize
	svgMinWidth  = 0.25 // narrower frames (and what they call) are not drawn
	// svgSplitWidth is the most a group at a split is widened to, so that
	// its label (ranks and function) shows however few ranks it holds.
	svgSplitWidth = 300.0
)

// WriteSVG draws the tree of kind k as a self-contained flame graph: no
// external reference. The outermost frames (process states) are at the
// bottom; a frame's width is its Weight. A frame reads as the operator
// wants it: the ranks whose stacks pass through it first, then the short
// function (package.Func) and the file's base name and line; hovering
// shows the full label and the counts.
//
// Where ranks part ways (a frame whose ranks differ from its parent's),
// the frame is outlined in red, and the groups smaller than their largest
// sibling, the ranks that are not where the others are, in a thicker red
// with a bold label. Such a group is drawn at least wide enough for its
// label (up to 300 px), its siblings narrower to make room: one rank of 64
// in another function reads without zooming. A small inline script lets a
// reader click a frame to zoom into it and search frames by name (as
// flamegraph.pl does); without it the picture is the same, still. The
// output is a function of m alone, so it can be compared byte for byte.
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
	bw.WriteString(`<style>text{font-family:monospace;font-size:` + fmtPx(svgFontSize) + `px;fill:#000}.t{font-size:16px}.s{fill:#444}` +
		`g.f{cursor:pointer}g.f:hover rect{stroke:#000;stroke-width:1}rect.split{stroke:#c00;stroke-width:1.5}` +
		`rect.odd{stroke:#c00;stroke-width:2}g.odd text{font-weight:bold;fill:#900}g.hit rect{fill:rgb(230,0,230)}` +
		`.btn{fill:#036;text-decoration:underline;cursor:pointer}</style>` + "\n")
	bw.WriteString(`<rect x="0" y="0" width="100%" height="100%" fill="#f8f8f4"/>` + "\n")

	title := kindTitle(k) + " stacks"
	sub := "world " + strconv.Itoa(m.World) + " · stacks from " + rankText(m.Trees[k].stuckOrEmpty()) +
		" · missing " + rankText(m.Missing) + " · label: ranks · function · file:line · width: ranks per stack"
	writeText(bw, svgWidth/2, 24, "t", "middle", title)
	writeText(bw, svgWidth/2, 42, "s", "middle", sub)
	writeText(bw, svgWidth/2, 58, "s", "middle",
		"red outline: ranks part ways here; thick red: the ranks that are not where the others are, drawn wide enough to read")

	if root == nil || root.weight == 0 {
		writeText(bw, svgWidth/2, svgTop+svgFrameH, "s", "middle", "no "+string(k)+" stacks")
		bw.WriteString("</svg>\n")
		return bw.Flush()
	}

	for _, b := range m.layout(root) {
		n := b.n
		y := height - svgBottom - float64(b.depth+1)*svgFrameH
		label := cleanLabel(m.shortLabel(n), false)
		bw.WriteString(`<g class="f`)
		if b.odd {
			bw.WriteString(` odd`)
		}
		bw.WriteString(`" data-d="` + strconv.Itoa(b.depth) + `" data-l="`)
		xml.EscapeText(bw, []byte(label))
		bw.WriteString(`"><title>`)
		xml.EscapeText(bw, []byte(cleanLabel(m.Label(n), false)))
		bw.WriteString("\nstuck here: " + strconv.Itoa(n.Stuck.Len()) + " of " + strconv.Itoa(m.World) + " ranks; width " + strconv.Itoa(n.weight))
		if !n.Ends.isEmpty() {
			bw.WriteString("; innermost frame of ranks " + rankText(n.Ends))
		}
		if b.widened {
			bw.WriteString("; drawn wider than its share, to be read")
		}
		bw.WriteString(`</title><rect x="` + fmtPx(b.x) + `" y="` + fmtPx(y) + `" width="` + fmtPx(b.w) + `" height="` + fmtPx(svgFrameH-1) + `" rx="2" ry="2" fill="` + frameColor(k, n) + `"`)
		switch {
		case b.odd:
			bw.WriteString(` class="split odd"`)
		case b.split:
			bw.WriteString(` class="split"`)
		}
		bw.WriteString(`/><text x="` + fmtPx(b.x+3) + `" y="` + fmtPx(y+svgFrameH-5) + `">`)
		xml.EscapeText(bw, []byte(fitText(label, b.w)))
		bw.WriteString("</text></g>\n")
	}
	bw.WriteString(`<script type="text/ecmascript"><![CDATA[` + strings.ReplaceAll(svgScript, "{W}", fmtPx(svgWidth)) + "]]></script>\n")
	bw.WriteString("</svg>\n")
	return bw.Flush()
}

// svgScript zooms into a clicked frame (its ancestors span the width, its
// callees scale with it, the rest hides) and searches frames by a regular
// expression. Frames keep their drawn place in data attributes; a frame's
// full label is in data-l.
const svgScript = `
(function () {
  var W = {W}, P = 10, CW = 6.6, NS = "http://www.w3.org/2000/svg";
  var frames = Array.prototype.slice.call(document.querySelectorAll("g.f"));
  frames.forEach(function (g) {
    var r = g.querySelector("rect");
    g.bx = +r.getAttribute("x"); g.bw = +r.getAttribute("width"); g.bd = +g.getAttribute("data-d");
    g.addEventListener("click", function () { zoom(g); });
  });
  function fit(l, w) {
    var n = Math.floor((w - 6) / CW);
    if (n < 3) { return ""; }
    return l.length <= n ? l : l.slice(0, n - 2) + "..";
  }
  function place(g, x, w) {
    var r = g.querySelector("rect"), t = g.querySelector("text");
    r.setAttribute("x", x.toFixed(2)); r.setAttribute("width", w.toFixed(2));
    t.setAttribute("x", (x + 3).toFixed(2)); t.textContent = fit(g.getAttribute("data-l"), w);
    g.style.display = "";
  }
  function button(x, label, fn) {
    var t = document.createElementNS(NS, "text");
    t.setAttribute("x", x); t.setAttribute("y", 24); t.setAttribute("class", "btn");
    t.textContent = label; t.addEventListener("click", fn);
    document.documentElement.appendChild(t);
    return t;
  }
  var reset = button(P, "Reset zoom", function () {
    frames.forEach(function (g) { place(g, g.bx, g.bw); });
    reset.style.display = "none";
  });
  reset.style.display = "none";
  function zoom(z) {
    var s = (W - 2 * P) / z.bw, e = 0.01;
    frames.forEach(function (g) {
      if (g.bd < z.bd && g.bx <= z.bx + e && g.bx + g.bw >= z.bx + z.bw - e) {
        place(g, P, W - 2 * P);
      } else if (g.bd >= z.bd && g.bx >= z.bx - e && g.bx + g.bw <= z.bx + z.bw + e) {
        place(g, P + (g.bx - z.bx) * s, g.bw * s);
      } else {
        g.style.display = "none";
      }
    });
    reset.style.display = "";
  }
  var found = button(W - P - 160, "", function () {});
  button(W - P - 60, "Search", function () {
    var q = window.prompt("Frames matching (a regular expression):", "");
    if (q === null) { return; }
    var re, n = 0;
    try { re = new RegExp(q, "i"); } catch (err) { found.textContent = "bad expression"; return; }
    frames.forEach(function (g) {
      var hit = q !== "" && (re.test(g.getAttribute("data-l")) || re.test(g.querySelector("title").textContent));
      g.classList.toggle("hit", hit);
      if (hit) { n++; }
    });
    found.textContent = q === "" ? "" : n + " frames match";
  });
})();
`

// frameBox is where a frame is drawn.
type frameBox struct {
	n       *Node
	x, w    float64
	depth   int
	split   bool // its ranks differ from its parent's: ranks part ways here
	odd     bool // a split group smaller than its largest sibling
	widened bool // drawn wider than its share of the ranks
}

// layout places the frames of root's tree, left to right and outermost
// first. A node's width is its share of its parent's, by weight, except
// that the groups at a split are widened to their label's width (at most
// svgSplitWidth) at their siblings' expense.
func (m *Merged) layout(root *Node) []frameBox {
	var out []frameBox
	var place func(parent *Node, x, w float64, depth int)
	place = func(parent *Node, x, w float64, depth int) {
		ws, widened := m.childWidths(parent, parent == root, w)
		largest := 0
		for _, c := range parent.Children {
			largest = max(largest, c.Stuck.Len())
		}
		for i, c := range parent.Children {
			if ws[i] >= svgMinWidth {
				split := parts(parent, c, parent == root)
				out = append(out, frameBox{n: c, x: x, w: ws[i], depth: depth, split: split,
					odd: split && c.Stuck.Len() < largest, widened: widened[i]})
				place(c, x, ws[i], depth+1)
			}
			x += ws[i]
		}
	}
	place(root, svgPad, svgWidth-2*svgPad, 0)
	return out
}

// childWidths shares w among parent's children by weight (the ranks that
// end at parent keep their share, empty, at the right), widening each
// group at a split to its label's width where its share is narrower: the
// widened take what they need, the others share the rest by weight.
func (m *Merged) childWidths(parent *Node, top bool, w float64) ([]float64, []bool) {
	kids := parent.Children
	ws := make([]float64, len(kids))
	widened := make([]bool, len(kids))
	need := make([]float64, len(kids))
	var sum float64
	for i, c := range kids {
		if parts(parent, c, top) {
			need[i] = min(svgSplitWidth, float64(m.groupLabelLen(c)+1)*svgCharWidth+6)
			sum += need[i]
		}
	}
	if sum > w*0.9 { // too many to widen fully: each gets its part of 90%
		for i := range need {
			need[i] *= w * 0.9 / sum
		}
	}
	fixed := make([]bool, len(kids))
	for {
		room, weight := w, float64(parent.weight)
		for i, c := range kids {
			if fixed[i] {
				room -= need[i]
				weight -= float64(c.weight)
			}
		}
		changed := false
		for i, c := range kids {
			if fixed[i] {
				ws[i] = need[i]
				continue
			}
			ws[i] = 0
			if weight > 0 {
				ws[i] = room * float64(c.weight) / weight
			}
			if ws[i] < need[i] {
				fixed[i], widened[i], changed = true, true, true
			}
		}
		if !changed {
			return ws, widened
		}
	}
}

// groupLabelLen returns the longest label, in characters, of the frames
// from n on that hold n's ranks, all of them: those drawn as wide as n.
func (m *Merged) groupLabelLen(n *Node) int {
	l := utf8.RuneCountInString(m.shortLabel(n))
	for _, c := range n.Children {
		if c.Stuck.Equal(n.Stuck) {
			l = max(l, m.groupLabelLen(c))
		}
	}
	return l
}

// parts reports whether child's ranks part from the others at parent: a
// frame whose ranks differ from its parent's, or, at the root, a process
// state beside another.
func parts(parent, child *Node, root bool) bool {
	if root {
		return len(parent.Children) > 1
	}
	return !child.isState && !child.Stuck.Equal(parent.Stuck)
}

// shortLabel is a frame's label as an operator reads it: the ranks whose
// stacks pass through it, the function without its package path and
// argument list, and the file's base name and line.
func (m *Merged) shortLabel(n *Node) string {
	if n.isState {
		return n.Stuck.String() + " · " + n.Frame.Func
	}
	b := make([]byte, 0, 64)
	b = n.Stuck.appendText(b)
	b = append(b, " · "...)
	b = append(b, shortFunc(n.Frame.Func)...)
	b = append(b, ' ')
	f := n.Frame
	if f.File != "" {
		f.File = path.Base(f.File)
	}
	return string(appendFileLine(b, f))
}

// shortFunc drops a function's package path (github.com/x/y/pkg.F is
// pkg.F) and a C++ argument list (ns::f(int, char) is ns::f).
func shortFunc(fn string) string {
	if i := strings.LastIndexByte(fn, '/'); i >= 0 && !strings.HasPrefix(fn, "[") {
		if j := strings.IndexByte(fn[i:], '('); j < 0 || fn[i+j-1] == '.' {
			fn = fn[i+1:]
		}
	}
	for i := 1; i < len(fn); i++ {
		if fn[i] == '(' && fn[i-1] != '.' && strings.Contains(fn[:i], "::") {
			return fn[:i]
		}
	}
	return fn
}

func (n *Node) stuckOrEmpty() Ranks {
	if n == nil {
		return Ranks{}
	}
	return n.Stuck
}

func rankText(r Ranks) string {
	if r.isEmpty() {
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
