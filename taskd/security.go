package taskd

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strings"
	"sync"
	"time"
	"unicode"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
)

// Security says how members authenticate each other. Set the three files
// for mutual TLS, a Token for a shared secret, or both. Plaintext is used
// only when Insecure is set, and is logged loudly.
type Security struct {
	// CertFile and KeyFile are this member's certificate and key (PEM);
	// CAFile holds the certificates that sign peers' certificates. They are
	// read again when they change, so rotated certificates take effect on
	// the next connection without a restart.
	CertFile, KeyFile, CAFile string
	// ServerName is the name a client expects in the server's certificate;
	// empty means the host part of the address dialled.
	ServerName string
	// Token is a shared secret every call carries and every server checks.
	Token string
	// Insecure allows connections without TLS.
	Insecure bool
}

// MinTokenBytes is the length of the shortest token a server takes: 128
// bits. A server refuses to start with a shorter one.
const MinTokenBytes = 16

// checkToken says what is wrong with a token a server is to take, named
// field; an empty token is none.
func checkToken(field, token string) error {
	switch {
	case token == "":
		return nil
	case len(token) < MinTokenBytes:
		return fmt.Errorf("taskd: %s: %d bytes, want at least %d (128 bits); make one with: openssl rand -hex 16", field, len(token), MinTokenBytes)
	case strings.IndexFunc(token, func(r rune) bool { return unicode.IsSpace(r) || unicode.IsControl(r) }) >= 0:
		return fmt.Errorf("taskd: %s: holds white space or a control character", field)
	}
	return nil
}

// SecurityFromDir returns a Security with the Kubernetes TLS secret names
// in dir: ca.crt, tls.crt and tls.key.
func SecurityFromDir(dir string) Security {
	return Security{CertFile: dir + "/tls.crt", KeyFile: dir + "/tls.key", CAFile: dir + "/ca.crt"}
}

func (s Security) tls() bool { return s.CertFile != "" || s.KeyFile != "" || s.CAFile != "" }

// Validate reports what is missing or contradictory.
func (s Security) Validate() error {
	if s.tls() {
		for _, f := range []struct{ name, v string }{{"CertFile", s.CertFile}, {"KeyFile", s.KeyFile}, {"CAFile", s.CAFile}} {
			if f.v == "" {
				return fmt.Errorf("taskd: Security.%s: empty, but mutual TLS needs CertFile, KeyFile and CAFile", f.name)
			}
		}
		if s.Insecure {
			return errors.New("taskd: Security.Insecure: set together with TLS files")
		}
		return nil
	}
	if !s.Insecure {
		return errors.New("taskd: Security: no TLS files and Insecure not set (set CertFile, KeyFile and CAFile for mutual TLS, or Insecure for plaintext)")
	}
	return nil
}

func (s Security) warn(log *slog.Logger, side string) {
	if s.tls() {
		return
	}
	if s.Token != "" {
		log.Warn("TASKD IS USING PLAINTEXT: the shared token and every message cross the network unencrypted; set mutual TLS for anything but a trusted network", "side", side)
		return
	}
	log.Warn("TASKD IS USING PLAINTEXT WITHOUT AUTHENTICATION: anyone who reaches the port can join the job; set mutual TLS or a token", "side", side)
}

// serverCreds returns the transport credentials of a server; the token
// is the guard's to check.
func (s Security) serverCreds(log *slog.Logger) credentials.TransportCredentials {
	s.warn(log, "server")
	if s.tls() {
		r := &certReloader{cert: s.CertFile, key: s.KeyFile, ca: s.CAFile, log: log}
		cfg := &tls.Config{
			MinVersion: tls.VersionTLS12,
			GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
				c, err := r.current()
				if err != nil {
					return nil, err
				}
				return &tls.Config{
					MinVersion:   tls.VersionTLS12,
					Certificates: []tls.Certificate{*c.cert},
					ClientCAs:    c.pool,
					ClientAuth:   tls.RequireAndVerifyClientCert,
					NextProtos:   []string{"h2"},
				}, nil
			},
		}
		return credentials.NewTLS(cfg)
	}
	return insecure.NewCredentials()
}

// dialOptions returns the credentials for a client dialling one of
// addrs. A server's certificate must name the host of one of them, or
// ServerName.
func (s Security) dialOptions(addrs []string, log *slog.Logger) []grpc.DialOption {
	s.warn(log, "client")
	var opts []grpc.DialOption
	if s.tls() {
		r := &certReloader{cert: s.CertFile, key: s.KeyFile, ca: s.CAFile, log: log}
		names := []string{s.ServerName}
		if s.ServerName == "" {
			names = names[:0]
			for _, addr := range addrs {
				name := addr
				if h, _, err := net.SplitHostPort(addr); err == nil {
					name = h
				}
				names = append(names, name)
			}
		}
		cfg := &tls.Config{
			MinVersion: tls.VersionTLS12,
			// The server is verified in VerifyConnection against the CA file
			// as it is now, so that a rotated CA takes effect without a
			// restart; the standard verification would pin the pool read at
			// start.
			InsecureSkipVerify: true,
			GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
				c, err := r.current()
				if err != nil {
					return nil, err
				}
				return c.cert, nil
			},
			VerifyConnection: func(cs tls.ConnectionState) error {
				c, err := r.current()
				if err != nil {
					return err
				}
				if len(cs.PeerCertificates) == 0 {
					return errors.New("taskd: server sent no certificate")
				}
				inter := x509.NewCertPool()
				for _, ic := range cs.PeerCertificates[1:] {
					inter.AddCert(ic)
				}
				// The connection may be to any of the addresses: the
				// certificate names one of them.
				for _, name := range names {
					if _, err = cs.PeerCertificates[0].Verify(x509.VerifyOptions{Roots: c.pool, Intermediates: inter, DNSName: name, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err == nil {
						return nil
					}
				}
				return err
			},
		}
		opts = append(opts, grpc.WithTransportCredentials(credentials.NewTLS(cfg)))
	} else {
		opts = append(opts, grpc.WithTransportCredentials(insecure.NewCredentials()))
	}
	if s.Token != "" {
		opts = append(opts, grpc.WithPerRPCCredentials(tokenCreds{token: s.Token, secure: s.tls()}))
	}
	return opts
}

type tokenCreds struct {
	token  string
	secure bool
}

func (t tokenCreds) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + t.token}, nil
}

func (t tokenCreds) RequireTransportSecurity() bool { return t.secure }

// certReloader serves the certificate, key and CA files, reading them again
// when their size or modification time changes. After a failed reload the
// last good set stays in force.
type certReloader struct {
	cert, key, ca string
	log           *slog.Logger

	mu    sync.Mutex
	stamp [3]fileStamp
	good  *certSet
}

type certSet struct {
	cert *tls.Certificate
	pool *x509.CertPool
}

type fileStamp struct {
	size int64
	mod  time.Time
}

func (r *certReloader) current() (*certSet, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	var st [3]fileStamp
	for i, name := range []string{r.cert, r.key, r.ca} {
		fi, err := os.Stat(name)
		if err != nil {
			if r.good != nil {
				r.log.Error("taskd: TLS file unreadable, keeping the last good certificates", "file", name, "err", err)
				return r.good, nil
			}
			return nil, fmt.Errorf("taskd: TLS file: %w", err)
		}
		st[i] = fileStamp{fi.Size(), fi.ModTime()}
	}
	if r.good != nil && st == r.stamp {
		return r.good, nil
	}
	set, err := loadCertSet(r.cert, r.key, r.ca)
	if err != nil {
		if r.good != nil {
			r.log.Error("taskd: TLS files changed but do not load, keeping the last good certificates", "err", err)
			return r.good, nil
		}
		return nil, err
	}
	if r.good != nil {
		r.log.Info("taskd: TLS certificates reloaded", "cert", r.cert, "ca", r.ca)
	}
	r.good, r.stamp = set, st
	return set, nil
}

func loadCertSet(certFile, keyFile, caFile string) (*certSet, error) {
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return nil, fmt.Errorf("taskd: load %s and %s: %w", certFile, keyFile, err)
	}
	pem, err := os.ReadFile(caFile)
	if err != nil {
		return nil, fmt.Errorf("taskd: read CA file: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("taskd: CA file %s: no PEM certificate in it", caFile)
	}
	return &certSet{cert: &cert, pool: pool}, nil
}

// peerHost returns the host part of a peer address.
func peerHost(addr string) string {
	if h, _, err := net.SplitHostPort(addr); err == nil {
		return h
	}
	return strings.TrimSpace(addr)
}
