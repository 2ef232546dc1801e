// Package fakedriver builds the fake driver libraries kept as C sources in
// npu/testdata with the system C compiler and drives them through the
// fake_control function each of them exports. It exists for the tests of
// package npu, which load the same libraries through npu's real dlopen path.
//
// Without cgo the package is empty.
package fakedriver
