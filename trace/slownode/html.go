package slownode

import (
	"fmt"
	"html/template"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
)

// maxChartRanks bounds the ranks drawn one by one in a chart: the slow
// ones, then others spread over the job, beside the job's median.
const maxChartRanks = 64

// WriteHTML writes r as one self-contained page (no network access):
// the verdict, the findings with their evidence, charts of the figures
// that set the slow ranks apart (compute, dataloader, send or
// communication time per rank, the onset marked) and of the job's step
// time, and the trajectory table (gap, forward+backward, trailing, ...)
// that sorts by any column when its header is clicked. Figures no rank
// has are left out of the charts and the tables, and listed with the
// reason.
func WriteHTML(w io.Writer, r *Result) error {
	page := htmlPage{R: r, Ranks: rankedRanks(r), Cols: rankColumns(r)}
	for _, f := range r.Findings {
		page.Waited = page.Waited || f.WaitedOn > 0
		page.Scores = page.Scores || f.RelativeScore > 0 || f.IndividualScore > 0
	}
	if r.History != nil {
		page.Charts = buildCharts(r)
	}
	if err := htmlTemplate.Execute(w, page); err != nil {
		return fmt.Errorf("slownode: write html: %w", err)
	}
	return nil
}

type htmlPage struct {
	R      *Result
	Ranks  []RankSummary
	Cols   []rankColumn
	Charts []chart
	Waited bool // some finding has WaitedOn
	Scores bool // some finding has a score
}

// chartFigure is a figure charts can draw per rank.
type chartFigure struct {
	title  string
	series Series
}

var (
	chartCompute = chartFigure{"Compute time", SeriesCompute}
	chartData    = chartFigure{"Dataloader time", SeriesDataLoader}
	chartComm    = chartFigure{"Communication time", SeriesComm}
	chartSend    = chartFigure{"Send time", SeriesSend}
)

// buildCharts returns the job's step time, then, for each figure that
// sets a finding's ranks apart, that figure per rank: those ranks in red
// over the others and the job's median, from the onset on marked. Ranks
// of a data-parallel job finish each step together, so their step times
// coincide; what differs is what each did inside the step.
func buildCharts(r *Result) []chart {
	out := []chart{jobChart(r)}
	type sel struct {
		fig   chartFigure
		ranks []int
		onset int64
		note  string
	}
	var sels []*sel
	add := func(fig chartFigure, ranks []int, onset int64, note string) {
		for _, s := range sels {
			if s.fig.title == fig.title {
				for _, rk := range ranks {
					if !slices.Contains(s.ranks, rk) {
						s.ranks = append(s.ranks, rk)
					}
				}
				s.onset = min(s.onset, onset)
				if s.note == "" {
					s.note = note
				}
				return
			}
		}
		sels = append(sels, &sel{fig, slices.Clone(ranks), onset, note})
	}
	for _, f := range r.Findings {
		switch f.Kind {
		case KindCompute, KindHost:
			if f.Metric == "compute" {
				add(chartCompute, f.Ranks, f.OnsetStep, "")
			} else {
				add(chartComm, f.Ranks, f.OnsetStep, "the slow rank waits least: the others wait for it")
			}
		case KindIO:
			add(chartData, f.Ranks, f.OnsetStep, "")
		case KindLink:
			add(chartSend, f.Ranks, f.OnsetStep, "")
		case KindCommunicationDomain:
			add(chartComm, f.Ranks, f.OnsetStep, "")
		}
	}
	if len(sels) == 0 && len(r.History.Job(SeriesCompute)) > 0 {
		add(chartCompute, nil, -1, "")
	}
	for _, s := range sels {
		if c, ok := rankChart(r, s.fig, s.ranks, s.onset, s.note); ok {
			out = append(out, c)
		}
	}
	return out
}

type chart struct {
	Title  string
	Note   string
	W, H   int
	Lines  []chartLine
	Labels []chartLabel // at the right end of the slow ranks' lines
	XTicks []chartTick
	YTicks []chartTick
	Marks  []chartMark // vertical: onset, phase changes
	Base   *chartTick  // horizontal: the baseline
	Legend []chartLegend
	Empty  bool
}

type chartLine struct {
	Points string
	Class  string
	Label  string
}

type chartLabel struct {
	X, Y float64
	Text string
}

type chartTick struct {
	Pos   float64
	Label string
}

type chartMark struct {
	X     float64
	Label string
	Class string
}

type chartLegend struct {
	X     int
	Class string
	Text  string
}

const (
	chartW, chartH              = 1100, 310
	padL, padR, padTop, padBott = 60, 80, 36, 30
	legendY                     = 10 // the legend's row, above the onset's label
)

// plot maps steps and milliseconds into a chart's frame.
type plot struct {
	minX, maxX int64
	maxY       float64
}

func (p *plot) scan(pts []Point) {
	for _, q := range pts {
		p.minX, p.maxX, p.maxY = min(p.minX, q.Step), max(p.maxX, q.Step), max(p.maxY, q.Value)
	}
}

func newPlot() *plot { return &plot{minX: math.MaxInt64, maxX: math.MinInt64} }

func (p *plot) empty() bool { return p.minX > p.maxX || p.maxY <= 0 }

func (p *plot) frame() {
	if p.maxX == p.minX {
		p.maxX = p.minX + 1
	}
	p.maxY *= 1.08
}

func (p *plot) x(step int64) float64 {
	return padL + float64(chartW-padL-padR)*float64(step-p.minX)/float64(p.maxX-p.minX)
}

func (p *plot) y(v float64) float64 { return padTop + float64(chartH-padTop-padBott)*(1-v/p.maxY) }

func (p *plot) poly(pts []Point) string {
	var b strings.Builder
	for i, q := range pts {
		if i > 0 {
			b.WriteByte(' ')
		}
		fmt.Fprintf(&b, "%.1f,%.1f", p.x(q.Step), p.y(q.Value))
	}
	return b.String()
}

func (p *plot) ticks(c *chart) {
	for i := 0; i <= 4; i++ {
		v := p.maxY * float64(i) / 4
		c.YTicks = append(c.YTicks, chartTick{p.y(v), strconv.FormatFloat(v, 'f', 0, 64)})
		st := p.minX + (p.maxX-p.minX)*int64(i)/4
		c.XTicks = append(c.XTicks, chartTick{p.x(st), strconv.FormatInt(st, 10)})
	}
}

// mark adds a vertical mark at step, where it is on the chart.
func (p *plot) mark(c *chart, step int64, label, class string) {
	if step >= p.minX && step <= p.maxX {
		c.Marks = append(c.Marks, chartMark{p.x(step), label, class})
	}
}

// jobChart draws the job's step time (the median over ranks), its
// baseline, the onset and the phase changes.
func jobChart(r *Result) chart {
	c := chart{Title: "Step time of the job (ms, median over ranks)", W: chartW, H: chartH}
	p := newPlot()
	job := r.History.Job(SeriesStep)
	p.scan(job)
	p.maxY = max(p.maxY, r.BaselineMs)
	if p.empty() {
		c.Empty = true
		return c
	}
	p.frame()
	c.Lines = append(c.Lines, chartLine{p.poly(job), "job", "job median"})
	c.Legend = append(c.Legend, chartLegend{0, "job", "step time"})
	if r.BaselineMs > 0 {
		c.Base = &chartTick{p.y(r.BaselineMs), "baseline " + fmtMs(r.BaselineMs)}
		c.Legend = append(c.Legend, chartLegend{0, "base", "baseline"})
	}
	if r.IsSlow == 1 {
		p.mark(&c, r.OnsetStep, "onset, step "+strconv.FormatInt(r.OnsetStep, 10), "onset")
	}
	for _, ph := range r.PhaseChanges {
		p.mark(&c, ph.Step, "phase, step "+strconv.FormatInt(ph.Step, 10), "phase")
	}
	p.ticks(&c)
	legend(&c)
	return c
}

// rankChart draws a figure per rank: slow ones in red with their label,
// others in grey, the job's median in black, the onset marked.
func rankChart(r *Result, fig chartFigure, slow []int, onset int64, note string) (chart, bool) {
	job := r.History.Job(fig.series)
	if len(job) == 0 {
		return chart{}, false // not computed
	}
	c := chart{Title: fig.title + " per rank (ms)", Note: note, W: chartW, H: chartH}
	var others []int
	for _, rk := range r.Ranks {
		if !slices.Contains(slow, rk.Rank) {
			others = append(others, rk.Rank)
		}
	}
	slow = slow[:min(len(slow), maxChartRanks/2)]
	room := maxChartRanks - len(slow)
	var shown []int
	for i := 0; i < room && i < len(others); i++ {
		shown = append(shown, others[i*len(others)/min(room, len(others))])
	}
	p := newPlot()
	p.scan(job)
	for _, rk := range slices.Concat(slow, shown) {
		p.scan(r.History.Rank(rk, fig.series))
	}
	if p.empty() {
		return chart{}, false
	}
	p.frame()
	for _, rk := range shown {
		c.Lines = append(c.Lines, chartLine{p.poly(r.History.Rank(rk, fig.series)), "rank", "rank " + strconv.Itoa(rk)})
	}
	c.Lines = append(c.Lines, chartLine{p.poly(job), "job", "job median"})
	for _, rk := range slow {
		pts := r.History.Rank(rk, fig.series)
		if len(pts) == 0 {
			continue
		}
		c.Lines = append(c.Lines, chartLine{p.poly(pts), "slow", "rank " + strconv.Itoa(rk) + " (slow)"})
		last := pts[len(pts)-1]
		c.Labels = append(c.Labels, chartLabel{p.x(last.Step) + 4, p.y(last.Value), "rank " + strconv.Itoa(rk)})
	}
	spreadLabels(c.Labels)
	if onset >= 0 {
		p.mark(&c, onset, "onset, step "+strconv.FormatInt(onset, 10), "onset")
	}
	c.Legend = append(c.Legend, chartLegend{0, "job", "job median"})
	if len(slow) > 0 {
		c.Legend = append(c.Legend, chartLegend{0, "slow", "slow ranks"})
	}
	if len(shown) > 0 {
		c.Legend = append(c.Legend, chartLegend{0, "rank", "other ranks"})
	}
	p.ticks(&c)
	legend(&c)
	return c, true
}

// legend lays the legend out in a row above the plot.
func legend(c *chart) {
	x := padL
	for i := range c.Legend {
		c.Legend[i].X = x
		x += 36 + 7*len(c.Legend[i].Text) + 18
	}
}

// spreadLabels moves labels apart vertically so that they do not overlap.
func spreadLabels(ls []chartLabel) {
	slices.SortFunc(ls, func(a, b chartLabel) int { return int(a.Y - b.Y) })
	for i := 1; i < len(ls); i++ {
		ls[i].Y = max(ls[i].Y, ls[i-1].Y+13)
	}
}

var htmlTemplate = template.Must(template.New("page").Funcs(template.FuncMap{
	"ms":      fmtMs,
	"f3":      func(v float64) string { return strconv.FormatFloat(v, 'f', 3, 64) },
	"ints":    joinInts,
	"join":    strings.Join,
	"subject": func(f Finding) string { return f.subject() },
	"sub":     func(a, b int) int { return a - b },
	"dash":    func(v float64, f func(float64) string) string { return orDash(v, f) },
	"msf":     func() func(float64) string { return fmtMs },
	"ratiof":  func() func(float64) string { return fmtRatio },
	"scoref": func() func(float64) string {
		return func(v float64) string { return strconv.FormatFloat(v, 'f', 3, 64) }
	},
	"cell":    func(c rankColumn, r RankSummary) string { return c.cell(&r) },
	"waited":  func(f Finding) string { return f.waitedText() },
	"padL":    func() int { return padL },
	"padTop":  func() int { return padTop },
	"head":    func(c rankColumn) string { return c.long },
	"plotR":   func() int { return chartW - padR },
	"plotB":   func() int { return chartH - padBott },
	"legendY": func() int { return legendY },
	"add":     func(a, b int) int { return a + b },
}).Parse(`<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>Slow-node report: {{.R.JobID}}</title>
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222;max-width:1400px}
h1{font-size:1.4em}h2{font-size:1.1em;margin-top:1.5em}
.slow{color:#b00;font-weight:600}.ok{color:#080}
.note{color:#555;margin:.2em 0}
table{border-collapse:collapse;font-variant-numeric:tabular-nums}
th,td{border:1px solid #ccc;padding:2px 5px;text-align:right;white-space:nowrap}
th{background:#f3f3f3;cursor:pointer;user-select:none}
td.l,th.l{text-align:left}
tr.st-slow td{background:#fde8e8}tr.st-silent td{background:#eee;color:#777}
svg{max-width:100%;height:auto}
svg .rank{fill:none;stroke:#bbb;stroke-width:1}
svg .job{fill:none;stroke:#222;stroke-width:2}
svg polyline.slow,svg line.slow{fill:none;stroke:#d22;stroke-width:2.5}
svg line.base{stroke:#2a7;stroke-width:1.5;stroke-dasharray:6 4}
svg line.onset{stroke:#d22;stroke-width:1.5;stroke-dasharray:4 3}
svg line.phase{stroke:#37c;stroke-width:1.5;stroke-dasharray:4 3}
svg text{font-size:12px;fill:#555}
svg text.slow{fill:#d22;stroke:none;font-weight:600}
svg text.onset{fill:#d22}svg text.phase{fill:#37c}svg text.base{fill:#2a7}
svg .axis{stroke:#888}
</style></head><body>
<h1>Slow-node report: {{.R.JobID}}</h1>
{{with .R}}
<p>{{if eq .IsSlow 1}}<span class="slow">SLOW</span> since step {{.OnsetStep}}, degradation {{.DegradationLevel}}, confidence {{f3 .Confidence}}{{else if lt .LastStep 0}}No step evaluated yet{{else}}<span class="ok">Not slow</span>{{end}}{{if ge .LastStep 0}} — last step {{.LastStep}}{{end}}{{if gt .BaselineMs 0.0}}; step time baseline {{ms .BaselineMs}} ms, recent {{ms .StepMs}} ms{{end}}.</p>
<ul>
{{if .SlowCalculateRanks}}<li>Slow compute ranks: {{ints .SlowCalculateRanks}}</li>{{end}}
{{if .SlowHostNodes}}<li>Slow hosts: {{join .SlowHostNodes " "}}</li>{{end}}
{{range .SlowCommunicationDomains}}<li>Slow communication domain: [{{ints .}}]</li>{{end}}
{{if .SlowIORanks}}<li>Slow IO ranks: {{ints .SlowIORanks}}</li>{{end}}
{{if .SlowCommunicationRanks}}<li>Slow link ranks: {{ints .SlowCommunicationRanks}}</li>{{end}}
{{if .SilentRanks}}<li>Silent ranks (stopped writing): {{ints .SilentRanks}}</li>{{end}}
{{range .PhaseChanges}}<li>Phase change at step {{.Step}}: step time {{ms .FromMs}} → {{ms .ToMs}} ms, hitting every rank alike: not a slow node</li>{{end}}
{{range .Input.Warnings}}<li>Warning: {{.}}</li>{{end}}
</ul>
{{if .Unavailable}}<p class="note">Not computed, and left out below:</p><ul class="note">
{{range .Unavailable}}<li>{{.Figure}}: {{.Reason}}</li>
{{end}}</ul>{{end}}
{{end}}
{{if .R.Findings}}
<h2>Findings</h2>
<table class="sortable"><thead><tr><th class="l">Kind</th><th class="l">Subject</th><th class="l">Metric</th><th class="l">Method</th><th>Peers ms</th><th>Recent ms</th><th>Ratio</th>{{if .Waited}}<th class="l">Peers waited for it, ms</th>{{end}}{{if .Scores}}<th>Relative</th><th>Individual</th>{{end}}<th>Onset</th><th>Seen</th><th>Confidence</th></tr></thead><tbody>
{{range .R.Findings}}<tr><td class="l">{{.Kind}}</td><td class="l">{{subject .}}</td><td class="l">{{.Metric}}</td><td class="l">{{.Method}}</td><td>{{dash .Baseline msf}}</td><td>{{dash .Recent msf}}</td><td>{{dash .Ratio ratiof}}</td>{{if $.Waited}}<td class="l">{{waited .}}</td>{{end}}{{if $.Scores}}<td>{{dash .RelativeScore scoref}}</td><td>{{dash .IndividualScore scoref}}</td>{{end}}<td>{{.OnsetStep}}</td><td>{{.DetectedStep}}</td><td>{{f3 .Confidence}}</td></tr>
{{end}}</tbody></table>
{{end}}
{{range $c := .Charts}}
<h2>{{.Title}}</h2>
{{if .Note}}<p class="note">{{.Note}}</p>{{end}}
{{if .Empty}}<p>No step evaluated yet.</p>{{else}}
<svg xmlns="http://www.w3.org/2000/svg" width="{{.W}}" height="{{.H}}" viewBox="0 0 {{.W}} {{.H}}" role="img">
<line class="axis" x1="{{padL}}" y1="{{padTop}}" x2="{{padL}}" y2="{{plotB}}"/><line class="axis" x1="{{padL}}" y1="{{plotB}}" x2="{{plotR}}" y2="{{plotB}}"/>
{{range .YTicks}}<text x="{{sub padL 5}}" y="{{.Pos}}" text-anchor="end" dominant-baseline="middle">{{.Label}}</text>{{end}}
{{range .XTicks}}<text x="{{.Pos}}" y="{{sub $c.H 10}}" text-anchor="middle">step {{.Label}}</text>{{end}}
{{with .Base}}<line class="base" x1="{{padL}}" y1="{{.Pos}}" x2="{{plotR}}" y2="{{.Pos}}"/>{{end}}
{{range .Lines}}<polyline class="{{.Class}}" points="{{.Points}}"><title>{{.Label}}</title></polyline>{{end}}
{{range .Marks}}<line class="{{.Class}}" x1="{{.X}}" y1="{{sub padTop 6}}" x2="{{.X}}" y2="{{plotB}}"/><text class="{{.Class}}" x="{{.X}}" y="{{sub padTop 10}}" text-anchor="middle">{{.Label}}</text>{{end}}
{{range .Labels}}<text class="slow" x="{{.X}}" y="{{.Y}}" dominant-baseline="middle">{{.Text}}</text>{{end}}
{{range .Legend}}<line class="{{.Class}}" x1="{{.X}}" y1="{{legendY}}" x2="{{add .X 30}}" y2="{{legendY}}"/><text x="{{add .X 36}}" y="{{legendY}}" dominant-baseline="middle">{{.Text}}</text>{{end}}
</svg>{{end}}
{{end}}
<h2>Iteration trajectory per rank, ms (click a header to sort)</h2>
<table class="sortable"><thead><tr><th>Rank</th><th class="l">Node</th><th>Stage</th><th class="l">Status</th>{{range .Cols}}<th>{{head .}}</th>{{end}}<th>Last</th><th class="l">Flags</th></tr></thead><tbody>
{{range $r := .Ranks}}<tr class="st-{{.Status}}"><td>{{.Rank}}</td><td class="l">{{.Node}}</td><td>{{.Stage}}</td><td class="l">{{.Status}}</td>{{range $.Cols}}<td>{{cell . $r}}</td>{{end}}<td>{{.LastStep}}</td><td class="l">{{join .Flags ","}}</td></tr>
{{end}}</tbody></table>
<p>Figures are medians over each rank's recent steps; "-" where a rank's markers do not give one. Steps are matched across ranks by number, never by timestamp: host clocks are not comparable.</p>
<script>
document.querySelectorAll("table.sortable th").forEach(function (th) {
  th.title = "click to sort";
  th.addEventListener("click", function () {
    var i = th.cellIndex, body = th.closest("table").tBodies[0], asc = th.dataset.dir !== "asc";
    th.dataset.dir = asc ? "asc" : "desc";
    Array.from(body.rows).sort(function (a, b) {
      var x = a.cells[i].textContent, y = b.cells[i].textContent, nx = parseFloat(x), ny = parseFloat(y);
      var c = (isNaN(nx) || isNaN(ny)) ? x.localeCompare(y) : nx - ny;
      return asc ? c : -c;
    }).forEach(function (r) { body.appendChild(r); });
  });
});
</script>
</body></html>
`))
