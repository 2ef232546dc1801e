// Package taskdpb holds the protocol of the taskd control plane: taskd.proto
// and the Go code protoc generates from it. It is internal: embedders use
// package taskd.
//
// To regenerate after editing taskd.proto (Debian package protobuf-compiler
// provides protoc; the plugins come from the Go module proxy at the versions
// that match google.golang.org/protobuf and google.golang.org/grpc in go.mod):
//
//	apt-get install protobuf-compiler
//	go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
//	go install google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.6.2
//	go generate ./internal/taskdpb
//
// protoc-gen-go v1.36.12 is google.golang.org/protobuf's own version; the
// code protoc-gen-go-grpc v1.6.2 writes needs google.golang.org/grpc
// v1.64.0 or later.
package taskdpb

//go:generate protoc --proto_path=. --go_out=. --go_opt=paths=source_relative --go-grpc_out=. --go-grpc_opt=paths=source_relative taskd.proto
