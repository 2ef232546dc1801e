//go:build !unix

package taskd

// defaultMaxConnections is a fixed bound where the open-file limit is not
// known.
func defaultMaxConnections() int { return 4096 }
