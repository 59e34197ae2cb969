//! A stop and a continue of the test process (SIGSTOP, SIGCONT: a CI host pausing its jobs, a
//! shell's job control) interrupts a receive waiting on a socket with a timeout (`EINTR`, not
//! restarted on Linux: signal(7)). Stop 49's CI run failed once so: a test's request ended in
//! "Interrupted system call" and the suite went red with nothing wrong in idemgate. The tests'
//! HTTP client reads on after such an interruption (`support::http::read_some`); this test stops
//! and continues a copy of the test binary while its request waits for its answer.

use crate::support;

use std::io::{BufRead as _, BufReader, Write as _};
use std::net::TcpListener;
use std::process::{Command, Stdio};

use support::http;

const CHILD: &str = "IDEMGATE_INTERRUPTED_CHILD";
const NAME: &str = "interrupted::a_request_waiting_for_its_answer_survives_its_process_being_stopped_and_continued";

/// In the copy: a server that answers once the parent says so (a line on stdin), and a request
/// to it through the tests' client, which must come back whole.
fn child() {
    let listener = TcpListener::bind(("127.0.0.1", 0)).expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let server = std::thread::spawn(move || {
        let (mut c, _) = listener.accept().expect("accept");
        http::read_request_head(&mut c);
        println!("request-read");
        std::io::stdout().flush().expect("flush");
        let mut go = String::new();
        std::io::stdin().read_line(&mut go).expect("the parent's go");
        c.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\nanswered").expect("answer");
    });
    let r = http::request(port, "GET", "/", &[], b"").expect("the answer, read on after the stop");
    assert_eq!((r.status, r.body_text().as_str()), (200, "answered"));
    server.join().expect("server");
    println!("client-answered");
}

#[test]
fn a_request_waiting_for_its_answer_survives_its_process_being_stopped_and_continued() {
    if std::env::var_os(CHILD).is_some() {
        return child();
    }
    let mut c = Command::new(std::env::current_exe().expect("the test binary"))
        .args([NAME, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the copy");
    let mut out = BufReader::new(c.stdout.take().expect("stdout"));
    let mut seen = String::new();
    let mut line = String::new();
    while !seen.contains("request-read") {
        line.clear();
        let n = out.read_line(&mut line).expect("the copy's output");
        assert!(n > 0, "the copy ended before its request arrived: {seen}");
        seen.push_str(&line);
    }
    support::stop_and_continue_while_receiving(c.id());
    c.stdin.take().expect("stdin").write_all(b"go\n").expect("go");
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut out, &mut rest);
    let o = c.wait_with_output().expect("the copy's end");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success() && rest.contains("client-answered") && rest.contains("1 passed"),
        "the copy's request did not survive the stop: {}\n{seen}{rest}\n{err}",
        o.status
    );
}
