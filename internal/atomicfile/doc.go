// Package atomicfile writes files so that a reader sees either the old
// content or the new one, never a torn mix, even across a crash or a power
// loss: the data goes to a temporary file in the same directory, is synced,
// renamed over the target, and the directory is synced.
//
//	if err := atomicfile.WriteFile("/ckpt/latest.txt", []byte("100\n"), 0o640); err != nil {
//		return err
//	}
//
// For large content, Create returns a *File to stream into; Commit makes it
// visible under its final name and Abort throws it away. Lock serialises
// writers across processes (a flock on a lock file beside the files).
package atomicfile
