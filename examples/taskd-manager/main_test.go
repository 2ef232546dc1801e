package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/faultline-ml/faultline/taskd"
)

// TestTokenFiles: a token file that holds nothing but white space (a
// secret never filled in) stops the manager, and overrides no variable;
// a token too short to be a secret stops it too.
func TestTokenFiles(t *testing.T) {
	dir := t.TempDir()
	write := func(name, data string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	t.Setenv("TASKD_TOKEN", "from-the-environment-0123456789")
	if _, err := security("", write("blank", " \n\t\n"), true); err == nil || !strings.Contains(err.Error(), "--token-file") || !strings.Contains(err.Error(), "empty") {
		t.Fatalf("a blank token file: %v", err)
	}
	sec, err := security("", write("good", "from-the-file-0123456789\n"), true)
	if err != nil || sec.Token != "from-the-file-0123456789" {
		t.Fatalf("a token file: %q %v", sec.Token, err)
	}
	if sec, err := security("", "", true); err != nil || sec.Token != "from-the-environment-0123456789" {
		t.Fatalf("the environment: %q %v", sec.Token, err)
	}
	if _, err := readToken("--admin-token-file", write("blank2", "\n"), "TASKD_ADMIN_TOKEN"); err == nil || !strings.Contains(err.Error(), "--admin-token-file") {
		t.Fatalf("a blank admin token file: %v", err)
	}
	t.Setenv("TASKD_TOKEN", "short")
	sec, err = security("", "", true)
	if err != nil {
		t.Fatal(err)
	}
	if err := (taskd.ManagerConfig{Job: "j", Security: sec}).Validate(); err == nil || !strings.Contains(err.Error(), "Security.Token") {
		t.Fatalf("a short token: %v", err)
	}
}
