//! Hub downloads against a local server that speaks the hub's file API (nothing here reaches
//! the internet): resolve URLs with LFS redirects, `Range` requests, ETags, repo listings, a
//! gated repo answering 401, and a connection dropped mid-file.

mod common;

use sha2::Digest;
use std::collections::{BTreeMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// One repo the mock serves: its commit, files, and the token it requires (gated) if any.
#[derive(Clone, Default)]
struct MockRepo {
    commit: String,
    files: BTreeMap<String, Vec<u8>>,
    token: Option<String>,
}

#[derive(Default)]
struct State {
    /// `models/org/name` or `datasets/org/name` -> repo.
    repos: BTreeMap<String, MockRepo>,
    /// Request lines received, in order.
    log: Vec<String>,
    /// Files whose next full download is cut off halfway (the connection closes).
    drop_once: HashSet<String>,
    /// sha256 -> content, for the LFS "CDN" the resolve URLs redirect to.
    blobs: BTreeMap<String, Vec<u8>>,
    /// Blobs the CDN sends half of and then goes silent on (the connection stays open).
    stall: HashSet<String>,
    /// Blobs the CDN serves with one byte changed.
    corrupt: HashSet<String>,
}

struct MockHub {
    url: String,
    state: Arc<Mutex<State>>,
}

fn sha256_hex(b: &[u8]) -> String {
    sha2::Sha256::digest(b).iter().map(|x| format!("{x:02x}")).collect()
}

impl MockHub {
    fn start() -> MockHub {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let state = Arc::new(Mutex::new(State::default()));
        let (st, base) = (state.clone(), url.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let (st, base) = (st.clone(), base.clone());
                std::thread::spawn(move || serve(conn, &st, &base));
            }
        });
        MockHub { url, state }
    }

    /// Serve every file under `dir` as repo `key` (`models/org/name`).
    fn add_repo(&self, key: &str, dir: &Path, token: Option<&str>) {
        let mut files = BTreeMap::new();
        collect(dir, dir, &mut files);
        let mut st = self.state.lock().unwrap();
        for (name, bytes) in &files {
            if is_lfs(name) {
                st.blobs.insert(sha256_hex(bytes), bytes.clone());
            }
        }
        let commit = sha256_hex(key.as_bytes())[..40].to_string();
        st.repos.insert(key.to_string(), MockRepo { commit, files, token: token.map(String::from) });
    }

    fn requests(&self) -> Vec<String> {
        self.state.lock().unwrap().log.clone()
    }
}

fn collect(root: &Path, dir: &Path, out: &mut BTreeMap<String, Vec<u8>>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        if e.path().is_dir() {
            collect(root, &e.path(), out);
        } else {
            let rel = e.path().strip_prefix(root).unwrap().to_string_lossy().to_string();
            out.insert(rel, std::fs::read(e.path()).unwrap());
        }
    }
}

/// The hub stores weights and data in LFS: their resolve URL redirects to a CDN and their
/// ETag is the content's sha256.
fn is_lfs(name: &str) -> bool {
    name.ends_with(".safetensors") || name.ends_with(".arrow") || name.ends_with(".parquet")
}

fn respond(conn: &mut TcpStream, status: &str, headers: &[(&str, String)], body: &[u8]) {
    let mut head = format!("HTTP/1.1 {status}\r\nConnection: close\r\nContent-Length: {}\r\n", body.len());
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let _ = conn.write_all(head.as_bytes());
    let _ = conn.write_all(body);
}

/// Serve `bytes` honouring a `Range` header; a file in `drop_once` has its first full-body
/// answer cut off halfway.
fn send_ranged(conn: &mut TcpStream, range: Option<&str>, bytes: &[u8], extra: &[(&str, String)], drop_now: bool) {
    let total = bytes.len();
    let (start, end) = match range.and_then(|r| r.strip_prefix("bytes=")) {
        Some(r) => {
            let (a, b) = r.split_once('-').unwrap();
            let a: usize = a.parse().unwrap();
            let b: usize = if b.is_empty() { total.saturating_sub(1) } else { b.parse::<usize>().unwrap().min(total - 1) };
            (a, b)
        }
        None => (0, total.saturating_sub(1)),
    };
    let body = if total == 0 { &bytes[..0] } else { &bytes[start..=end] };
    let mut headers = extra.to_vec();
    headers.push(("Content-Range", format!("bytes {start}-{end}/{total}")));
    let status = if range.is_some() { "206 Partial Content" } else { "200 OK" };
    if drop_now {
        let mut head = format!("HTTP/1.1 {status}\r\nConnection: close\r\nContent-Length: {}\r\n", body.len());
        for (k, v) in &headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        let _ = conn.write_all(head.as_bytes());
        let _ = conn.write_all(&body[..body.len() / 2]);
        let _ = conn.flush();
        let _ = conn.shutdown(std::net::Shutdown::Both);
        return;
    }
    respond(conn, status, &headers, body);
}

fn serve(mut conn: TcpStream, st: &Mutex<State>, base: &str) {
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() {
        return;
    }
    let mut headers = BTreeMap::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).is_err() || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.trim().split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    let path = line.split_whitespace().nth(1).unwrap_or("/").to_string();
    let range = headers.get("range").cloned();
    let auth = headers.get("authorization").cloned();
    st.lock().unwrap().log.push(format!("GET {path}{}", range.as_deref().map(|r| format!(" [{r}]")).unwrap_or_default()));

    if let Some(sha) = path.strip_prefix("/cdn/") {
        if st.lock().unwrap().stall.contains(sha) && range.as_deref() != Some("bytes=0-0") {
            let b = st.lock().unwrap().blobs.get(sha).cloned().unwrap_or_default();
            let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\nContent-Range: bytes 0-{}/{}\r\n\r\n", b.len(), b.len().saturating_sub(1), b.len());
            let _ = conn.write_all(head.as_bytes());
            let _ = conn.write_all(&b[..b.len() / 2]);
            let _ = conn.flush();
            std::thread::sleep(std::time::Duration::from_secs(120));
            return;
        }
        let (bytes, drop_now) = {
            let mut s = st.lock().unwrap();
            let mut bytes = s.blobs.get(sha).cloned();
            if let Some(b) = bytes.as_mut().filter(|b| !b.is_empty() && s.corrupt.contains(sha)) {
                let last = b.len() - 1;
                b[last] ^= 1;
            }
            let full = range.as_deref() != Some("bytes=0-0");
            (bytes, full && s.drop_once.remove(sha))
        };
        return match bytes {
            Some(b) => send_ranged(&mut conn, range.as_deref(), &b, &[], drop_now),
            None => respond(&mut conn, "404 Not Found", &[], b"no such blob"),
        };
    }
    // /api/{models|datasets}/org/name/revision/rev  or  /[datasets/]org/name/resolve/rev/file
    let (kind, rest, api) = match path.strip_prefix("/api/") {
        Some(r) => (if r.starts_with("datasets/") { "datasets" } else { "models" }, r.split_once('/').unwrap().1.to_string(), true),
        None => match path.strip_prefix("/datasets/") {
            Some(r) => ("datasets", r.to_string(), false),
            None => ("models", path[1..].to_string(), false),
        },
    };
    let parts: Vec<&str> = rest.splitn(5, '/').collect();
    if parts.len() < 4 {
        return respond(&mut conn, "404 Not Found", &[], b"bad path");
    }
    let key = format!("{kind}/{}/{}", parts[0], parts[1]);
    let repo = st.lock().unwrap().repos.get(&key).cloned();
    // As the hub does: an unknown repo answers 401 RepoNotFound (it could be private), an
    // unknown revision 404; a gated repo lists its files but refuses downloads without a token.
    let Some(repo) = repo else {
        return respond(&mut conn, "401 Unauthorized", &[("x-error-code", "RepoNotFound".into())], b"Repository not found");
    };
    if parts[3] != "main" && parts[3] != repo.commit {
        return respond(&mut conn, "404 Not Found", &[("x-error-code", "RevisionNotFound".into())], b"Invalid rev id");
    }
    if let Some(t) = repo.token.as_ref().filter(|_| !api) {
        if auth.as_deref() != Some(&format!("Bearer {t}")) {
            return respond(&mut conn, "401 Unauthorized", &[("x-error-code", "GatedRepo".into())], b"Access to this repo is restricted");
        }
    }
    if api {
        let siblings: Vec<serde_json::Value> = repo.files.keys().map(|f| serde_json::json!({ "rfilename": f })).collect();
        let body = serde_json::json!({ "id": format!("{}/{}", parts[0], parts[1]), "sha": repo.commit, "siblings": siblings }).to_string();
        return respond(&mut conn, "200 OK", &[("Content-Type", "application/json".into())], body.as_bytes());
    }
    let file = parts.get(4).copied().unwrap_or("");
    let Some(bytes) = repo.files.get(file) else {
        return respond(&mut conn, "404 Not Found", &[("x-error-code", "EntryNotFound".into())], b"Entry not found");
    };
    let commit = ("x-repo-commit", repo.commit.clone());
    if is_lfs(file) {
        let sha = sha256_hex(bytes);
        let headers = [commit, ("x-linked-etag", format!("\"{sha}\"")), ("x-linked-size", bytes.len().to_string()), ("Location", format!("{base}/cdn/{sha}"))];
        return respond(&mut conn, "302 Found", &headers, b"");
    }
    // Small files live in git: their ETag is the git blob id, not a sha256.
    let etag = ("ETag", format!("\"{}\"", &sha256_hex(bytes)[..40]));
    let drop_now = range.as_deref() != Some("bytes=0-0") && st.lock().unwrap().drop_once.remove(file);
    send_ranged(&mut conn, range.as_deref(), bytes, &[commit, etag], drop_now);
}

/// A tiny model folder with config, tokenizer-free weights, and a tokenized dataset.
fn workspace() -> tempfile::TempDir {
    common::tiny_workspace(64, (6, 12), None)
}

fn recipe(model: &str, data: &str, extra: &str) -> String {
    format!(
        r#"[model]
path = "{model}"
dtype = "f32"
[lora]
rank = 4
alpha = 8
targets = ["q_proj", "v_proj"]
[data]
train = "{data}"
format = "tokenized"
max_seq_len = 32
[train]
micro_batch_size = 4
max_steps = 2
lr = 1e-3
activation_checkpointing = false
[output]
dir = "out"
{extra}"#
    )
}

fn finetune(dir: &Path, hub: &str, home: &Path, extra_env: &[(&str, &str)], args: &[&str]) -> std::process::Output {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_finetune"));
    cmd.current_dir(dir).args(args).env("HF_ENDPOINT", hub).env("HF_HOME", home).env_remove("HF_HUB_CACHE").env_remove("HF_TOKEN").env_remove("HF_HUB_OFFLINE");
    for (k, v) in extra_env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

/// A tiny model served as `models/tiny-org/tiny-llama` (gated by `token` if given), an empty
/// hub cache, and a run folder whose recipe names `model` and `data`.
struct Env {
    ws: tempfile::TempDir,
    hub: MockHub,
    home: tempfile::TempDir,
    run: PathBuf,
}

fn setup(model_repo: &str, token: Option<&str>, model: &str, data: &str, extra: &str) -> Env {
    let ws = workspace();
    let hub = MockHub::start();
    hub.add_repo(model_repo, &ws.path().join("model"), token);
    let home = tempfile::tempdir().unwrap();
    let run = ws.path().join("run");
    std::fs::create_dir_all(&run).unwrap();
    std::fs::write(run.join("recipe.toml"), recipe(model, data, extra)).unwrap();
    Env { ws, hub, home, run }
}

impl Env {
    fn finetune(&self, env: &[(&str, &str)], args: &[&str]) -> std::process::Output {
        finetune(&self.run, &self.hub.url, self.home.path(), env, args)
    }

    /// Serve the workspace's Arrow shard under each of `names` as dataset repo `key`.
    fn add_dataset(&self, key: &str, names: &[&str]) {
        let repo = self.ws.path().join(key.replace('/', "-"));
        let arrow = std::fs::read_dir(self.ws.path().join("data")).unwrap().flatten().find(|e| e.path().extension().is_some_and(|x| x == "arrow")).unwrap();
        for n in names {
            std::fs::create_dir_all(repo.join(n).parent().unwrap()).unwrap();
            std::fs::copy(arrow.path(), repo.join(n)).unwrap();
        }
        self.hub.add_repo(key, &repo, None);
    }
}

fn snapshot_files(home: &Path, folder: &str) -> Vec<PathBuf> {
    let snaps = home.join("hub").join(folder).join("snapshots");
    let mut out = Vec::new();
    for s in std::fs::read_dir(snaps).unwrap().flatten() {
        let mut files = BTreeMap::new();
        collect(&s.path(), &s.path(), &mut files);
        out.extend(files.keys().map(PathBuf::from));
    }
    out
}

#[test]
fn a_repo_id_downloads_trains_and_then_runs_from_the_cache_without_a_request() {
    let e = setup("models/tiny-org/tiny-llama", None, "tiny-org/tiny-llama", "tiny-org/counting", "");
    e.add_dataset("datasets/tiny-org/counting", &["data/train-00000-of-00001.arrow"]);
    let weights = std::fs::read(e.ws.path().join("model/model.safetensors")).unwrap();
    e.hub.state.lock().unwrap().drop_once.insert(sha256_hex(&weights));

    let first = e.finetune(&[], &["--recipe", "recipe.toml"]);
    assert!(first.status.success(), "{}", stderr(&first));
    let log = e.hub.requests();
    assert!(log.iter().any(|l| l.starts_with("GET /api/models/tiny-org/tiny-llama/revision/main")), "{log:?}");
    // Files are fetched at the commit the listing named, not at the moving branch.
    let pinned = e.hub.state.lock().unwrap().repos["models/tiny-org/tiny-llama"].commit.clone();
    let resolves: Vec<&String> = log.iter().filter(|l| l.contains("tiny-llama/resolve/")).collect();
    assert!(!resolves.is_empty() && resolves.iter().all(|l| l.contains(&format!("/resolve/{pinned}/"))), "{resolves:?}");
    // The weights were cut off once and resumed from where the cut left them.
    let resumed = log.iter().filter(|l| l.starts_with("GET /cdn/") && l.contains("[bytes=") && !l.contains("bytes=0-0]") && !l.contains("bytes=0-]")).count();
    assert!(resumed >= 1, "no ranged resume after the dropped connection: {log:?}");
    assert_eq!(common::read_metrics(&e.run.join("out/metrics.jsonl")).len(), 2);
    // The run records the commits it read, the dataset's as the base's.
    let data_commit = e.hub.state.lock().unwrap().repos["datasets/tiny-org/counting"].commit.clone();
    let resolved = std::fs::read_to_string(e.run.join("out/recipe.resolved.toml")).unwrap();
    assert!(resolved.contains(&format!("train = \"tiny-org/counting@{data_commit}\"")) && resolved.contains(&format!("revision = \"{pinned}\"")), "{resolved}");
    // The standard cache layout: blobs, a ref, and the snapshot transformers would read.
    let cache = e.home.path().join("hub/models--tiny-org--tiny-llama");
    let commit = std::fs::read_to_string(cache.join("refs/main")).unwrap();
    let snap = cache.join("snapshots").join(commit.trim());
    assert_eq!(std::fs::read(snap.join("model.safetensors")).unwrap(), weights);
    assert!(std::fs::symlink_metadata(snap.join("config.json")).unwrap().file_type().is_symlink());
    assert_eq!(snapshot_files(e.home.path(), "datasets--tiny-org--counting"), vec![PathBuf::from("data/train-00000-of-00001.arrow")]);

    // Run again in a fresh output folder: everything comes from the cache.
    let before = e.hub.requests().len();
    let again = e.finetune(&[], &["--recipe", "recipe.toml", "--set", "output.dir=out2"]);
    assert!(again.status.success(), "{}", stderr(&again));
    assert_eq!(e.hub.requests()[before..].to_vec(), Vec::<String>::new(), "the second run asked the hub");
    let losses = |p: &Path| common::read_metrics(p).iter().map(|m| m["loss"].as_f64().unwrap()).collect::<Vec<_>>();
    assert_eq!(losses(&e.run.join("out2/metrics.jsonl")), losses(&e.run.join("out/metrics.jsonl")));
}

#[test]
fn a_gated_repo_needs_hf_token_and_says_so() {
    let e = setup("models/gated-org/tiny", Some("secret"), "gated-org/tiny", "../data", "");
    let refused = e.finetune(&[], &["--recipe", "recipe.toml"]);
    assert!(!refused.status.success());
    let err = stderr(&refused);
    assert!(err.contains("gated-org/tiny") && err.contains("the repo is gated") && err.contains("accept its terms") && err.contains("no token is set"), "{err}");
    assert!(!e.run.join("out").exists(), "a failed download left an output folder");
    let ok = e.finetune(&[("HF_TOKEN", "secret")], &["--recipe", "recipe.toml"]);
    assert!(ok.status.success(), "{}", stderr(&ok));
}

#[test]
fn offline_mode_names_what_the_cache_lacks_and_asks_nothing() {
    let e = setup("models/tiny-org/tiny-llama", None, "tiny-org/tiny-llama", "../data", "");
    let offline = [("HF_HUB_OFFLINE", "1")];
    let o = e.finetune(&offline, &["--recipe", "recipe.toml"]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(err.contains("HF_HUB_OFFLINE") && err.contains("tiny-org/tiny-llama") && err.contains("never downloaded"), "{err}");
    assert!(e.hub.requests().is_empty(), "offline mode made requests: {:?}", e.hub.requests());
    // A plan put config.json in the cache, not the weights: the error names them.
    assert!(e.finetune(&[], &["plan", "--recipe", "recipe.toml"]).status.success());
    let asked = e.hub.requests().len();
    let o = e.finetune(&offline, &["--recipe", "recipe.toml"]);
    let err = stderr(&o);
    assert!(!o.status.success() && err.contains("lacks model.safetensors"), "{err}");
    assert_eq!(e.hub.requests().len(), asked, "offline mode made requests");
}

#[test]
fn an_unknown_repo_or_revision_is_a_clear_error() {
    let e = setup("models/tiny-org/tiny-llama", None, "tiny-org/no-such-model", "../data", "");
    let o = e.finetune(&[], &["--recipe", "recipe.toml"]);
    assert!(!o.status.success());
    let err = stderr(&o);
    // The hub answers 401 for a repo that does not exist: the message must not send the user
    // after a token first.
    assert!(err.contains("tiny-org/no-such-model") && err.contains("no such model repo") && err.contains("check the repo id"), "{err}");
    let o = e.finetune(&[], &["--recipe", "recipe.toml", "--set", "model.path=tiny-org/tiny-llama", "--set", "model.revision=v9"]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(err.contains("tiny-org/tiny-llama@v9") && err.contains("no revision `v9`") && err.contains("model.revision"), "{err}");
    let o = e.finetune(&[], &["--recipe", "recipe.toml", "--set", "model.path=tiny-org/tiny-llama", "--set", "model.revision=../../x"]);
    assert!(!o.status.success() && stderr(&o).contains("the revision must be"), "{}", stderr(&o));
    assert!(!e.home.path().join("hub/x").exists() && !e.home.path().join("x").exists());
}

#[test]
fn a_download_that_does_not_match_its_etag_is_deleted_and_named() {
    let e = setup("models/tiny-org/tiny-llama", None, "tiny-org/tiny-llama", "../data", "");
    let sha = sha256_hex(&std::fs::read(e.ws.path().join("model/model.safetensors")).unwrap());
    e.hub.state.lock().unwrap().corrupt.insert(sha.clone());
    let o = e.finetune(&[], &["--recipe", "recipe.toml"]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(err.contains("model.safetensors") && err.contains("sha256") && err.contains("deleted"), "{err}");
    let cache = e.home.path().join("hub/models--tiny-org--tiny-llama");
    assert!(!cache.join("blobs").join(&sha).exists(), "the bad blob was kept");
    assert!(!e.run.join("out").exists());
    // Once the hub serves the right bytes, a rerun fetches the file anew and trains.
    e.hub.state.lock().unwrap().corrupt.clear();
    let o = e.finetune(&[], &["--recipe", "recipe.toml"]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn a_dataset_with_several_splits_and_none_named_train_must_be_told_which() {
    let e = setup("models/tiny-org/tiny-llama", None, "tiny-org/tiny-llama", "tiny-org/chats", "");
    e.add_dataset("datasets/tiny-org/chats", &["data/train_sft-00000-of-00001.arrow", "data/test_sft-00000-of-00001.arrow"]);
    let o = e.finetune(&[], &["--recipe", "recipe.toml"]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(err.contains("tiny-org/chats") && err.contains("test_sft, train_sft") && err.contains(":<split>"), "{err}");
    let o = e.finetune(&[], &["--recipe", "recipe.toml", "--set", "data.train=tiny-org/chats:train_sft"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(snapshot_files(e.home.path(), "datasets--tiny-org--chats"), vec![PathBuf::from("data/train_sft-00000-of-00001.arrow")]);
}

#[test]
fn a_resumed_run_after_the_branch_moved_is_refused() {
    let e = setup("models/tiny-org/tiny-llama", None, "tiny-org/tiny-llama", "../data", "[checkpoint]\nevery_steps = 1\n");
    let o = e.finetune(&[], &["--recipe", "recipe.toml"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let resolved = std::fs::read_to_string(e.run.join("out/recipe.resolved.toml")).unwrap();
    let commit = e.hub.state.lock().unwrap().repos["models/tiny-org/tiny-llama"].commit.clone();
    assert!(resolved.contains(&format!("revision = \"{commit}\"")), "the base is recorded at its commit: {resolved}");
    // Another tool downloaded a new push: the cache's `main` now names another commit.
    let cache = e.home.path().join("hub/models--tiny-org--tiny-llama");
    let moved = "f".repeat(40);
    copy_tree(&cache.join("snapshots").join(&commit), &cache.join("snapshots").join(&moved));
    copy_tree(&cache.join(".no_exist").join(&commit), &cache.join(".no_exist").join(&moved));
    std::fs::write(cache.join("refs/main"), &moved).unwrap();
    let o = e.finetune(&[], &["--recipe", "recipe.toml", "--set", "train.max_steps=3"]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(err.contains("model.revision") && err.contains(&commit) && err.contains(&moved), "{err}");
}

/// A repo with both model.safetensors and an index (with its shards) gives the single file
/// alone, as transformers downloads and loads it: before, the index and its shards were
/// fetched and trained on, a base `from_pretrained` does not load.
#[test]
fn a_repo_with_a_single_file_and_an_index_gives_the_single_file_as_transformers_does() {
    let e = setup("models/tiny-org/tiny-llama", None, "tiny-org/both", "tiny-org/counting", "");
    e.add_dataset("datasets/tiny-org/counting", &["data/train-00000-of-00001.arrow"]);
    let both = e.ws.path().join("both");
    copy_tree(&e.ws.path().join("model"), &both);
    std::fs::write(both.join("model.safetensors.index.json"), r#"{"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00001.safetensors"}}"#).unwrap();
    std::fs::write(both.join("model-00001-of-00001.safetensors"), b"not the model").unwrap();
    e.hub.add_repo("models/tiny-org/both", &both, None);
    let out = e.finetune(&[], &["--recipe", "recipe.toml"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let files = snapshot_files(e.home.path(), "models--tiny-org--both");
    assert!(files.contains(&PathBuf::from("model.safetensors")) && !files.iter().any(|f| f.to_string_lossy().contains("00001")), "{files:?}");
}

fn copy_tree(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap().flatten() {
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
}

#[test]
fn plan_fetches_config_json_alone() {
    let e = setup("models/tiny-org/tiny-llama", None, "tiny-org/tiny-llama", "../data", "");
    let o = e.finetune(&[], &["plan", "--recipe", "recipe.toml"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(snapshot_files(e.home.path(), "models--tiny-org--tiny-llama"), vec![PathBuf::from("config.json")]);
    assert!(!e.hub.requests().iter().any(|l| l.contains("/cdn/")), "plan downloaded weights: {:?}", e.hub.requests());
}

#[test]
fn plan_of_the_shipped_recipes_needs_no_network() {
    let home = tempfile::tempdir().unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for r in ["recipes/deepseek-7b-lora.toml", "recipes/deepseek-v2-lite-lora.toml", "recipes/deepseek-v3-lora.toml"] {
        // An endpoint nothing listens on: a request would fail the plan.
        let o = finetune(root, "http://127.0.0.1:9", home.path(), &[], &["plan", "--recipe", r]);
        assert!(o.status.success(), "{r}: {}", stderr(&o));
        assert!(String::from_utf8_lossy(&o.stdout).contains("GiB"), "{r}: {}", String::from_utf8_lossy(&o.stdout));
    }
}

#[test]
fn export_of_a_run_merges_into_the_commit_it_trained_on_after_the_branch_moved() {
    // The base is recorded at its commit; `export --run` (and the end-of-run merge) resolved
    // the branch again, so after another job's download moved `main` they merged the adapter
    // into other weights. `org/name@rev` names a revision as --base too.
    let e = setup("models/tiny-org/tiny-llama", None, "tiny-org/tiny-llama", "../data", "[checkpoint]\nevery_steps = 1\n");
    let o = e.finetune(&[], &["--recipe", "recipe.toml"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let commit = e.hub.state.lock().unwrap().repos["models/tiny-org/tiny-llama"].commit.clone();
    let cache = e.home.path().join("hub/models--tiny-org--tiny-llama");
    let moved = "f".repeat(40);
    copy_tree(&cache.join("snapshots").join(&commit), &cache.join("snapshots").join(&moved));
    let other = e.ws.path().join("other");
    finetune::synth::write_model(&other, &finetune::synth::TinyShape { vocab: 64, ..Default::default() }, 77, 1).unwrap();
    let weights = cache.join("snapshots").join(&moved).join("model.safetensors");
    std::fs::remove_file(&weights).unwrap();
    std::fs::copy(other.join("model.safetensors"), &weights).unwrap();
    std::fs::write(cache.join("refs/main"), &moved).unwrap();
    let offline = [("HF_HUB_OFFLINE", "1")];
    let embed = |dir: &Path| common::load_tensors(&dir.join("model.safetensors"))["model.embed_tokens.weight"].clone();
    let trained = embed(&cache.join("snapshots").join(&commit));
    let o = e.finetune(&offline, &["export", "--run", "out", "--merge", "--out", "m1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(common::max_abs_diff(&embed(&e.run.join("m1")), &trained), 0.0, "merged into the commit the run trained on");
    let pinned = format!("tiny-org/tiny-llama@{commit}");
    let o = e.finetune(&offline, &["export", "--run", "out", "--merge", "--base", &pinned, "--out", "m2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = e.finetune(&offline, &["export", "--run", "out", "--merge", "--base", "tiny-org/tiny-llama", "--out", "m3"]);
    assert!(!o.status.success() && stderr(&o).contains("differ from those run"), "{}", stderr(&o));
    // A damaged record of the run is named, not read as absent (the branch's head).
    std::fs::write(e.run.join("out/recipe.resolved.toml"), "[model\n").unwrap();
    let o = e.finetune(&offline, &["export", "--run", "out", "--merge", "--out", "m4"]);
    assert!(!o.status.success() && stderr(&o).contains("recipe.resolved.toml") && stderr(&o).contains("damaged"), "{}", stderr(&o));
}

#[test]
fn the_cache_and_offline_switch_are_read_from_the_environment_as_huggingface_hub_reads_them() {
    // The older HUGGINGFACE_HUB_CACHE, a `~` left unexpanded in HF_HOME, and
    // TRANSFORMERS_OFFLINE=1 (offline to huggingface_hub too) were ignored: the run looked in
    // another cache, or tried the network.
    let e = setup("models/tiny-org/tiny-llama", None, "tiny-org/tiny-llama", "../data", "");
    let o = e.finetune(&[], &["plan", "--recipe", "recipe.toml"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let home = e.home.path().to_str().unwrap().to_string();
    let before = e.hub.requests().len();
    let run = |env: &[(&str, &str)], unset: &[&str]| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_finetune"));
        cmd.current_dir(&e.run).args(["plan", "--recipe", "recipe.toml"]).env("HF_ENDPOINT", "http://127.0.0.1:9");
        for k in ["HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "XDG_CACHE_HOME"].iter().chain(unset) {
            cmd.env_remove(k);
        }
        cmd.envs(env.iter().copied()).output().unwrap()
    };
    let legacy = format!("{home}/hub");
    for (env, what) in [
        (vec![("HUGGINGFACE_HUB_CACHE", legacy.as_str()), ("HF_HUB_OFFLINE", "1")], "HUGGINGFACE_HUB_CACHE"),
        (vec![("HOME", home.as_str()), ("HF_HOME", "~/"), ("HF_HUB_OFFLINE", "1")], "HF_HOME with ~"),
        (vec![("HF_HOME", home.as_str()), ("TRANSFORMERS_OFFLINE", "1")], "TRANSFORMERS_OFFLINE"),
    ] {
        let o = run(&env, &[]);
        assert!(o.status.success(), "{what}: {}", stderr(&o));
        assert!(!stderr(&o).contains("could not reach"), "{what} asked the network: {}", stderr(&o));
    }
    assert_eq!(e.hub.requests().len(), before);
}

/// `finetune` with a deadline: a hang fails the test instead of stopping it.
fn finetune_within(secs: u64, dir: &Path, hub: &str, home: &Path, env: &[(&str, &str)], args: &[&str]) -> (bool, String, f64) {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_finetune"));
    cmd.current_dir(dir).args(args).env("HF_ENDPOINT", hub).env("HF_HOME", home).env_remove("HF_HUB_CACHE").env_remove("HF_TOKEN").env_remove("HF_HUB_OFFLINE");
    cmd.envs(env.iter().copied()).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::piped());
    let started = std::time::Instant::now();
    let mut child = cmd.spawn().unwrap();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed().as_secs() > secs {
            child.kill().unwrap();
            panic!("finetune still running after {secs} s");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let o = child.wait_with_output().unwrap();
    (o.status.success(), stderr(&o), started.elapsed().as_secs_f64())
}

/// A hub (or proxy) that accepts the connection and then says nothing, for the listing or in
/// the middle of a download, is an error naming the timeout to raise, as huggingface_hub's
/// HF_HUB_ETAG_TIMEOUT / HF_HUB_DOWNLOAD_TIMEOUT make it; it used to hang the run for good.
#[test]
fn a_hub_that_goes_silent_is_an_error_naming_the_timeout_not_a_hang() {
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", silent.local_addr().unwrap());
    std::thread::spawn(move || {
        let held: Vec<TcpStream> = silent.incoming().flatten().collect(); // accepted, never answered
        drop(held);
    });
    let e = setup("models/tiny-org/tiny-llama", None, "tiny-org/tiny-llama", "../data", "");
    let (ok, err, secs) = finetune_within(60, &e.run, &url, e.home.path(), &[("HF_HUB_ETAG_TIMEOUT", "1")], &["--recipe", "recipe.toml"]);
    assert!(!ok && err.contains("HF_HUB_ETAG_TIMEOUT") && err.contains("sent nothing for 1 s"), "{err}");
    assert!(secs < 30.0, "{secs} s");
    // The listing answers; the weights stop arriving halfway.
    let weights = std::fs::read(e.ws.path().join("model/model.safetensors")).unwrap();
    e.hub.state.lock().unwrap().stall.insert(sha256_hex(&weights));
    let (ok, err, _) = finetune_within(60, &e.run, &e.hub.url, e.home.path(), &[("HF_HUB_DOWNLOAD_TIMEOUT", "1")], &["--recipe", "recipe.toml"]);
    assert!(!ok && err.contains("HF_HUB_DOWNLOAD_TIMEOUT") && err.contains("model.safetensors"), "{err}");
}

#[test]
fn a_dataset_repo_whose_data_is_json_files_alone_is_read() {
    // As yahma/alpaca-cleaned keeps its records: one JSON array in a .json file, beside the
    // hub's metadata. It was "has no .parquet, .arrow, .jsonl files".
    let e = setup("models/tiny-org/tiny-llama", None, "tiny-org/tiny-llama", "tiny-org/json-rows", "");
    let repo = e.ws.path().join("datasets-tiny-org-json-rows");
    std::fs::create_dir_all(&repo).unwrap();
    let rows: Vec<serde_json::Value> = (0..8u32).map(|i| serde_json::json!({ "input_ids": (0..12u32).map(|t| (t * 7 + i) % 200).collect::<Vec<_>>() })).collect();
    std::fs::write(repo.join("rows_cleaned.json"), serde_json::to_string_pretty(&rows).unwrap()).unwrap();
    std::fs::write(repo.join("dataset_infos.json"), "{}").unwrap();
    e.hub.add_repo("datasets/tiny-org/json-rows", &repo, None);
    let o = e.finetune(&[], &["--recipe", "recipe.toml"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(snapshot_files(e.home.path(), "datasets--tiny-org--json-rows"), vec![PathBuf::from("rows_cleaned.json")]);
}
