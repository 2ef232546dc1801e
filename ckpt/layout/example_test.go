package layout_test

import (
	"fmt"

	"github.com/faultline-ml/faultline/ckpt/layout"
)

// The blob table of a half is a documented byte format; StepMeta encodes
// and decodes it. A writer leaves it unsealed; the owner seals it with the
// CRC of every blob.
func ExampleParseStepMeta() {
	m := layout.StepMeta{Seq: 1, Step: 42, Blobs: []layout.BlobEntry{{Name: "model", Offset: 128, Size: 1000}}}
	b, _ := m.MarshalBinary()
	got, err := layout.ParseStepMeta(b, 4096)
	fmt.Println(len(b), got.Step, got.Blobs[0].Name, got.Blobs[0].Size, got.Sealed, err)

	m.Blobs[0].CRC32C, m.Sealed = layout.CRC32C(make([]byte, 1000)), true
	b, _ = m.MarshalBinary()
	got, err = layout.ParseStepMeta(b, 4096)
	fmt.Printf("%v %#08x %v\n", got.Sealed, got.Blobs[0].CRC32C, err)

	b[30] ^= 1 // a flipped bit
	_, err = layout.ParseStepMeta(b, 4096)
	fmt.Println(err)
	// Output:
	// 100 42 model 1000 false <nil>
	// true 0xd84dda57 <nil>
	// layout: offset 60: field meta_crc32c: value 0xa2decf93, computed 0x432239da
}
