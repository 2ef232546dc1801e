package freeport_test

import (
	"fmt"
	"net"
	"strconv"

	"github.com/faultline-ml/faultline/internal/freeport"
)

func ExampleFind() {
	port, err := freeport.Find(2)
	if err != nil {
		fmt.Println(err)
		return
	}
	l, err := net.Listen("tcp", ":"+strconv.Itoa(port+1))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer l.Close()
	fmt.Println("listening")
	// Output: listening
}
