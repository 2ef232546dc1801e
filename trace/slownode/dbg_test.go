package slownode

import (
	"encoding/json"
	"os"
	"testing"
)

func TestDbg(t *testing.T) {
	for _, sc := range scenarios(layout{8, 2, 4}, 60, 1) {
		if sc.name != os.Getenv("SC") {
			continue
		}
		_, r := runScenario(t, t.TempDir(), sc)
		r.Ranks = nil
		b, _ := json.MarshalIndent(r, "", " ")
		os.Stdout.Write(b)
	}
}
