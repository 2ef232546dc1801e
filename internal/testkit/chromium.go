package testkit

import (
	"bytes"
	"os/exec"
	"strconv"
	"strings"
	"testing"
)

// Chromium opens file in headless Chromium and returns the document as
// its scripts left it and the console's messages (an uncaught error among
// them), skipping the test where Chromium is not installed. With png set
// it also saves a screenshot of the first height pixels at 1,400 wide.
func Chromium(t testing.TB, file, png string, height int) (dom string, console []string) {
	t.Helper()
	bin, err := exec.LookPath("chromium")
	if err != nil {
		t.Skip("chromium not installed (Debian package chromium): the page is checked in a real browser")
	}
	run := func(args ...string) (stdout, stderr []byte) {
		args = append([]string{"--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
			"--disable-background-networking", "--disable-component-update", "--disable-sync",
			"--user-data-dir=" + t.TempDir(), "--enable-logging=stderr", "--v=0", "--hide-scrollbars"}, args...)
		cmd := exec.Command(bin, append(args, "file://"+file)...)
		var out, errb bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &errb
		if err := cmd.Run(); err != nil {
			t.Fatalf("chromium %v: %v\n%s", args, err, errb.Bytes())
		}
		return out.Bytes(), errb.Bytes()
	}
	out, errb := run("--dump-dom")
	for line := range strings.Lines(string(errb)) {
		if strings.Contains(line, ":CONSOLE") {
			console = append(console, strings.TrimSpace(line))
		}
	}
	if png != "" {
		run("--window-size=1400,"+strconv.Itoa(height), "--screenshot="+png)
	}
	return string(out), console
}
