package slownode

import (
	"fmt"
	"html/template"
	"io"
	"math"
	"strconv"
	"strings"
)

// maxChartRanks bounds the ranks drawn one by one in a chart: the slow
// ones, then others spread over the job, beside the job's median.
const maxChartRanks = 64

// WriteHTML writes r as one self-contained page (no network access):
// the verdict, the findings, a chart of step and compute time per rank,
// and the trajectory table (gap, forward+backward, trailing, ...) that
// sorts by any column when its header is clicked.
func WriteHTML(w io.Writer, r *Result) error {
	page := htmlPage{R: r, Ranks: rankedRanks(r)}
	if r.History != nil {
		page.Charts = []chart{
			buildChart("Step time per rank (ms)", r, func(s RankHistory) []Point { return s.Step }, r.History.JobStep),
			buildChart("Compute time per rank (ms)", r, func(s RankHistory) []Point { return s.Compute }, r.History.JobCompute),
		}
	}
	if err := htmlTemplate.Execute(w, page); err != nil {
		return fmt.Errorf("slownode: write html: %w", err)
	}
	return nil
}

type htmlPage struct {
	R      *Result
	Ranks  []RankSummary
	Charts []chart
}

type chart struct {
	Title  string
	W, H   int
	Lines  []chartLine
	XTicks []chartTick
	YTicks []chartTick
	Empty  bool
}

type chartLine struct {
	Points string
	Class  string
	Label  string
}

type chartTick struct {
	Pos   float64
	Label string
}

const (
	chartW, chartH              = 900, 300
	padL, padR, padTop, padBott = 60, 120, 10, 30
)

func buildChart(title string, r *Result, pick func(RankHistory) []Point, job []Point) chart {
	c := chart{Title: title, W: chartW, H: chartH}
	type sel struct {
		rank int
		slow bool
	}
	var chosen []sel
	var others []int
	for _, rk := range r.Ranks {
		if rk.Status == "slow" && len(chosen) < maxChartRanks/2 {
			chosen = append(chosen, sel{rk.Rank, true})
		} else {
			others = append(others, rk.Rank)
		}
	}
	room := maxChartRanks - len(chosen)
	for i := 0; i < room && i < len(others); i++ {
		chosen = append(chosen, sel{others[i*len(others)/min(room, len(others))], false})
	}
	minX, maxX, maxY := int64(math.MaxInt64), int64(math.MinInt64), 0.0
	scan := func(pts []Point) {
		for _, p := range pts {
			minX, maxX, maxY = min(minX, p.Step), max(maxX, p.Step), max(maxY, p.Value)
		}
	}
	scan(job)
	for _, s := range chosen {
		scan(pick(r.History.Ranks[s.rank]))
	}
	if minX > maxX || maxY <= 0 {
		c.Empty = true
		return c
	}
	if maxX == minX {
		maxX = minX + 1
	}
	maxY *= 1.05
	pw, ph := float64(chartW-padL-padR), float64(chartH-padTop-padBott)
	x := func(step int64) float64 { return padL + pw*float64(step-minX)/float64(maxX-minX) }
	y := func(v float64) float64 { return padTop + ph*(1-v/maxY) }
	poly := func(pts []Point) string {
		var b strings.Builder
		for i, p := range pts {
			if i > 0 {
				b.WriteByte(' ')
			}
			fmt.Fprintf(&b, "%.1f,%.1f", x(p.Step), y(p.Value))
		}
		return b.String()
	}
	for _, s := range chosen {
		if s.slow {
			continue
		}
		c.Lines = append(c.Lines, chartLine{poly(pick(r.History.Ranks[s.rank])), "rank", "rank " + strconv.Itoa(s.rank)})
	}
	c.Lines = append(c.Lines, chartLine{poly(job), "job", "job median"})
	for _, s := range chosen {
		if s.slow {
			c.Lines = append(c.Lines, chartLine{poly(pick(r.History.Ranks[s.rank])), "slow", "rank " + strconv.Itoa(s.rank) + " (slow)"})
		}
	}
	for i := 0; i <= 4; i++ {
		v := maxY * float64(i) / 4
		c.YTicks = append(c.YTicks, chartTick{y(v), strconv.FormatFloat(v, 'f', 0, 64)})
		st := minX + (maxX-minX)*int64(i)/4
		c.XTicks = append(c.XTicks, chartTick{x(st), strconv.FormatInt(st, 10)})
	}
	return c
}

var htmlTemplate = template.Must(template.New("page").Funcs(template.FuncMap{
	"ms":      fmtMs,
	"f3":      func(v float64) string { return strconv.FormatFloat(v, 'f', 3, 64) },
	"ints":    joinInts,
	"join":    strings.Join,
	"subject": func(f Finding) string { return f.subject() },
	"sub":     func(a, b int) int { return a - b },
}).Parse(`<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>Slow-node report: {{.R.JobID}}</title>
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.4em}h2{font-size:1.1em;margin-top:1.5em}
.slow{color:#b00;font-weight:600}.ok{color:#080}
table{border-collapse:collapse;font-variant-numeric:tabular-nums}
th,td{border:1px solid #ccc;padding:2px 6px;text-align:right}
th{background:#f3f3f3;cursor:pointer;user-select:none}
td.l,th.l{text-align:left}
tr.st-slow td{background:#fde8e8}tr.st-silent td{background:#eee;color:#777}
svg .rank{fill:none;stroke:#bbb;stroke-width:1}
svg .job{fill:none;stroke:#222;stroke-width:2}
svg .slow{fill:none;stroke:#d22;stroke-width:2}
svg text{font-size:11px;fill:#555}
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
{{if .Unavailable}}<li>Unavailable figures (no markers): {{join .Unavailable ", "}}</li>{{end}}
{{range .Input.Warnings}}<li>Warning: {{.}}</li>{{end}}
</ul>
{{if .Findings}}
<h2>Findings</h2>
<table class="sortable"><thead><tr><th class="l">Kind</th><th class="l">Subject</th><th class="l">Metric</th><th class="l">Method</th><th>Peers ms</th><th>Recent ms</th><th>Ratio</th><th>Relative</th><th>Individual</th><th>Onset</th><th>Seen</th><th>Confidence</th></tr></thead><tbody>
{{range .Findings}}<tr><td class="l">{{.Kind}}</td><td class="l">{{subject .}}</td><td class="l">{{.Metric}}</td><td class="l">{{.Method}}</td><td>{{ms .Baseline}}</td><td>{{ms .Recent}}</td><td>{{f3 .Ratio}}</td><td>{{f3 .RelativeScore}}</td><td>{{f3 .IndividualScore}}</td><td>{{.OnsetStep}}</td><td>{{.DetectedStep}}</td><td>{{f3 .Confidence}}</td></tr>
{{end}}</tbody></table>
{{end}}
{{end}}
{{range $c := .Charts}}
<h2>{{.Title}}</h2>
{{if .Empty}}<p>No data.</p>{{else}}
<svg xmlns="http://www.w3.org/2000/svg" width="{{.W}}" height="{{.H}}" viewBox="0 0 {{.W}} {{.H}}" role="img">
<line class="axis" x1="60" y1="10" x2="60" y2="{{sub .H 30}}"/><line class="axis" x1="60" y1="{{sub .H 30}}" x2="{{sub .W 120}}" y2="{{sub .H 30}}"/>
{{range .YTicks}}<text x="55" y="{{.Pos}}" text-anchor="end" dominant-baseline="middle">{{.Label}}</text>{{end}}
{{range .XTicks}}<text x="{{.Pos}}" y="{{sub $c.H 12}}" text-anchor="middle">step {{.Label}}</text>{{end}}
{{range .Lines}}<polyline class="{{.Class}}" points="{{.Points}}"><title>{{.Label}}</title></polyline>{{end}}
<text x="{{sub .W 115}}" y="20">— job median</text><text x="{{sub .W 115}}" y="36" fill="#d22" style="fill:#d22">— slow ranks</text><text x="{{sub .W 115}}" y="52">— other ranks</text>
</svg>{{end}}
{{end}}
<h2>Iteration trajectory per rank (click a header to sort)</h2>
<table class="sortable"><thead><tr><th>Rank</th><th class="l">Node</th><th>Stage</th><th class="l">Status</th><th>Step ms</th><th>Gap ms</th><th>FP+BP ms</th><th>Trailing ms</th><th>Compute ms</th><th>Forward ms</th><th>Dataloader ms</th><th>Checkpoint ms</th><th>Comm ms</th><th>Send ms</th><th>Relative</th><th>Individual</th><th>Last step</th><th class="l">Flags</th></tr></thead><tbody>
{{range .Ranks}}<tr class="st-{{.Status}}"><td>{{.Rank}}</td><td class="l">{{.Node}}</td><td>{{.Stage}}</td><td class="l">{{.Status}}</td><td>{{ms .StepMs}}</td><td>{{ms .GapMs}}</td><td>{{ms .FPBPMs}}</td><td>{{ms .TrailingMs}}</td><td>{{ms .ComputeMs}}</td><td>{{ms .ForwardMs}}</td><td>{{ms .DataLoaderMs}}</td><td>{{ms .CheckpointMs}}</td><td>{{ms .CommMs}}</td><td>{{ms .SendMs}}</td><td>{{f3 .RelativeScore}}</td><td>{{f3 .IndividualScore}}</td><td>{{.LastStep}}</td><td class="l">{{join .Flags ","}}</td></tr>
{{end}}</tbody></table>
<p>Figures are medians over each rank's recent steps. Steps are matched across ranks by number, never by timestamp: host clocks are not comparable.</p>
<script>
document.querySelectorAll("table.sortable th").forEach(function (th) {
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
