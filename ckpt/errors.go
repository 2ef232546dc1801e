package ckpt

import (
	"errors"
	"fmt"

	"github.com/faultline-ml/faultline/ckpt/layout"
)

func formatErr(off int64, field, format string, args ...any) *layout.ParseError {
	return &layout.ParseError{Offset: off, Field: field, Msg: fmt.Sprintf(format, args...)}
}

// withFile names the file in a *layout.ParseError, and otherwise returns
// err.
func withFile(err error, file string) error {
	var fe *layout.ParseError
	if errors.As(err, &fe) && fe.File == "" {
		c := *fe
		c.File = file
		return &c
	}
	return err
}
