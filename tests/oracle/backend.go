// The oracle's Go backend (tests/it/boundary_oracle.rs): net/http's ServeMux and Server with their
// defaults, the same contract as backends.py (a JSON-RPC request body is answered with what was
// read as the `result` of a JSON-RPC response with the request's `id`; a body that is not JSON is
// reported as the form ParseForm reads, `{"form": {name: [values]}, "files": {}}`, a
// multipart/form-data body as ParseMultipartForm reads it: text fields in `form`, each file as
// `[filename, sha256 of its content]` in `files`).
//
// usage: backend PORT
package main

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"sort"
	"strings"
	"sync/atomic"
)

var count int64

func read(route string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		atomic.AddInt64(&count, 1)
		params := map[string]string{}
		if route == "orders" {
			params["id"] = strings.TrimPrefix(r.URL.Path, "/v2/orders/")
		}
		var body interface{}
		if strings.Contains(strings.ToLower(r.Header.Get("Content-Type")), "json") {
			raw, _ := io.ReadAll(r.Body)
			if json.Unmarshal(raw, &body) != nil {
				body = nil
			}
		} else {
			// The form as net/http parses it (ParseForm: a urlencoded body of a POST, PUT or
			// PATCH), name -> [values in the order sent]; an error is what was read too.
			form := map[string][]string{}
			files := map[string][][2]string{}
			if strings.HasPrefix(strings.ToLower(r.Header.Get("Content-Type")), "multipart/") {
				if err := r.ParseMultipartForm(32 << 20); err != nil {
					form["(error)"] = []string{err.Error()}
				}
				if r.MultipartForm != nil {
					for k, fhs := range r.MultipartForm.File {
						for _, fh := range fhs {
							sum := ""
							if f, err := fh.Open(); err == nil {
								data, _ := io.ReadAll(f)
								f.Close()
								h := sha256.Sum256(data)
								sum = hex.EncodeToString(h[:])
							}
							files[k] = append(files[k], [2]string{fh.Filename, sum})
						}
					}
				}
			} else if err := r.ParseForm(); err != nil {
				form["(error)"] = []string{err.Error()}
			}
			for k, vs := range r.PostForm {
				form[k] = vs
			}
			body = map[string]interface{}{"form": form, "files": files}
		}
		q := [][2]string{}
		for k, vs := range r.URL.Query() {
			for _, v := range vs {
				q = append(q, [2]string{k, v})
			}
		}
		sort.Slice(q, func(i, j int) bool { return q[i][0] < q[j][0] || (q[i][0] == q[j][0] && q[i][1] < q[j][1]) })
		all := func(n string) []string {
			v := r.Header.Values(n)
			if v == nil {
				return []string{}
			}
			return v
		}
		out := map[string]interface{}{
			"route": route, "params": params, "method": r.Method, "path": r.URL.Path, "host": r.Host,
			"authorization": all("Authorization"), "x-caller": all("X-Caller"),
			"idempotency-key": all("Idempotency-Key"), "x-op": all("X-Op"),
			"query": q, "body": body,
		}
		var answer interface{} = out
		if m, ok := body.(map[string]interface{}); ok {
			if _, isCall := m["method"]; isCall {
				answer = map[string]interface{}{"jsonrpc": "2.0", "id": m["id"], "result": out}
			}
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(201)
		json.NewEncoder(w).Encode(answer)
	}
}

func main() {
	port := os.Args[1]
	mux := http.NewServeMux()
	mux.HandleFunc("/v1/payments", read("payments"))
	mux.HandleFunc("/v2/orders/", read("orders"))
	mux.HandleFunc("/__count", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "{\"count\": %d}", atomic.LoadInt64(&count))
	})
	fmt.Printf("PORT %s\n", port)
	if err := http.ListenAndServe("127.0.0.1:"+port, mux); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
