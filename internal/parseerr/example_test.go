package parseerr_test

import (
	"fmt"

	"github.com/faultline-ml/faultline/internal/parseerr"
)

func ExampleText() {
	fmt.Println(parseerr.Text{Pkg: "trace", Format: "profiling switch", Field: "Step", Value: "maybe", Msg: `want "on" or "off"`})
	fmt.Println(parseerr.Text{Pkg: "hang", Format: "stack file", File: "00003-00008.stacktrace", Line: 4, Msg: "last line cut short"})
	fmt.Println(parseerr.Text{Pkg: "topology", Format: "node-topology-config", Line: 2, Msg: "want 3 fields"})
	fmt.Println(parseerr.Text{Pkg: "layout", At: "offset 60", Field: "meta_crc32c", Msg: "value 0x1, computed 0x2"})
	// Output:
	// trace: profiling switch: field Step: value "maybe": want "on" or "off"
	// hang: stack file: 00003-00008.stacktrace:4: last line cut short
	// topology: node-topology-config: line 2: want 3 fields
	// layout: offset 60: field meta_crc32c: value 0x1, computed 0x2
}
