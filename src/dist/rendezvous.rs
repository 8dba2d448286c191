//! Where the processes of a multi-node run meet: process 0 listens on MASTER_ADDR:MASTER_PORT,
//! every other process connects and says who it is (its RANK and WORLD_SIZE), and once all
//! are there process 0 hands each the same payload (the NCCL unique id). Disagreements
//! (another WORLD_SIZE, a RANK twice) and processes that never arrive are errors that name
//! them, on every process, within the timeout.
//!
//! Wire format (little endian): hello = rank u64, world u64, ranks u64 (the total number of
//! ranks the process computed from its recipe, which must agree); reply = status u8 (0 ok,
//! 1 error), length u32, then the payload or the error text.

use crate::error::{Error, Result};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

fn err(rank: usize, msg: impl Into<String>) -> Error {
    Error::Dist { rank, msg: msg.into() }
}

/// Meet the other `world - 1` processes at `addr` ("host:port"). `ranks` is the total number
/// of ranks this process computed (devices per process x processes); all must agree. Process
/// 0 passes the `payload` to hand out; every process returns it.
pub fn rendezvous(addr: &str, rank: usize, world: usize, ranks: usize, payload: Option<&[u8]>, timeout: Duration) -> Result<Vec<u8>> {
    let deadline = Instant::now() + timeout;
    if rank == 0 {
        let payload = payload.ok_or_else(|| err(0, "process 0 has nothing to hand out"))?;
        host(addr, world, ranks, payload, deadline, timeout)
    } else {
        join(addr, rank, world, ranks, deadline, timeout)
    }
}

fn reply(s: &mut TcpStream, ok: bool, body: &[u8]) -> std::io::Result<()> {
    let mut msg = vec![if ok { 0u8 } else { 1 }];
    msg.extend((body.len() as u32).to_le_bytes());
    msg.extend(body);
    s.write_all(&msg)
}

fn host(addr: &str, world: usize, ranks: usize, payload: &[u8], deadline: Instant, timeout: Duration) -> Result<Vec<u8>> {
    let listener = TcpListener::bind(addr).map_err(|e| err(0, format!("cannot listen on {addr} (MASTER_ADDR:MASTER_PORT): {e}")))?;
    listener.set_nonblocking(true).map_err(|e| err(0, e.to_string()))?;
    let mut peers: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    let mut problem: Option<String> = None;
    while peers.iter().skip(1).any(|p| p.is_none()) && problem.is_none() {
        match listener.accept() {
            Ok((mut s, from)) => {
                s.set_nonblocking(false).ok();
                // A connection that never says hello (a port scan) must not hold up the others.
                s.set_read_timeout(Some(Duration::from_secs(5))).ok();
                let mut hello = [0u8; 24];
                if s.read_exact(&mut hello).is_err() {
                    continue; // not one of ours (a port scan, a health check)
                }
                let field = |i: usize| u64::from_le_bytes(hello[8 * i..8 * i + 8].try_into().unwrap_or_default()) as usize;
                let (r, w, n) = (field(0), field(1), field(2));
                let bad = if w != world {
                    Some(format!("process {r} at {from} says WORLD_SIZE={w}, process 0 says {world}"))
                } else if n != ranks {
                    Some(format!("process {r} at {from} counts {n} ranks, process 0 counts {ranks} (dist.devices / dist.world_size differ between nodes)"))
                } else if r == 0 || r >= world {
                    Some(format!("a process at {from} says RANK={r}; expected 1..{}", world - 1))
                } else if peers[r].is_some() {
                    Some(format!("two processes say RANK={r}"))
                } else {
                    None
                };
                match bad {
                    Some(m) => {
                        let _ = reply(&mut s, false, m.as_bytes());
                        problem = Some(m);
                    }
                    None => peers[r] = Some(s),
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<usize> = (1..world).filter(|&r| peers[r].is_none()).collect();
                    problem = Some(format!(
                        "timed out after {} s at the rendezvous on {addr}: process(es) {missing:?} never arrived",
                        timeout.as_secs()
                    ));
                } else {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            Err(e) => problem = Some(format!("accept on {addr}: {e}")),
        }
    }
    if let Some(m) = problem {
        for s in peers.iter_mut().flatten() {
            let _ = reply(s, false, m.as_bytes());
        }
        return Err(err(0, m));
    }
    for (r, s) in peers.iter_mut().enumerate().skip(1) {
        if let Some(s) = s {
            reply(s, true, payload).map_err(|e| err(0, format!("sending the id to process {r}: {e}")))?;
        }
    }
    Ok(payload.to_vec())
}

fn join(addr: &str, rank: usize, world: usize, ranks: usize, deadline: Instant, timeout: Duration) -> Result<Vec<u8>> {
    // Process 0 may not be listening yet: retry until the deadline.
    let mut s = loop {
        let target = addr.to_socket_addrs().map_err(|e| err(rank, format!("MASTER_ADDR:MASTER_PORT = {addr}: {e}")))?.next();
        let target = target.ok_or_else(|| err(rank, format!("{addr} resolves to no address")))?;
        match TcpStream::connect_timeout(&target, Duration::from_millis(500)) {
            Ok(s) => break s,
            Err(e) if Instant::now() >= deadline => {
                return Err(err(rank, format!("timed out after {} s reaching process 0 at {addr}: {e}", timeout.as_secs())))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    };
    let mut hello = (rank as u64).to_le_bytes().to_vec();
    hello.extend((world as u64).to_le_bytes());
    hello.extend((ranks as u64).to_le_bytes());
    s.write_all(&hello).map_err(|e| err(rank, format!("rendezvous at {addr}: {e}")))?;
    // Wait a little past our own deadline: process 0 times out at about the same moment and
    // then says who never arrived, which is the message worth showing.
    s.set_read_timeout(Some(deadline.saturating_duration_since(Instant::now()) + Duration::from_secs(5))).ok();
    let mut head = [0u8; 5];
    s.read_exact(&mut head).map_err(|e| err(rank, format!("no answer from process 0 at {addr} within {} s: {e}", timeout.as_secs())))?;
    let len = u32::from_le_bytes([head[1], head[2], head[3], head[4]]) as usize;
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).map_err(|e| err(rank, format!("rendezvous at {addr}: {e}")))?;
    if head[0] != 0 {
        return Err(err(rank, format!("process 0 refused the rendezvous: {}", String::from_utf8_lossy(&body))));
    }
    Ok(body)
}

/// "MASTER_ADDR:MASTER_PORT" from the environment, as torchrun sets them.
pub fn master_addr(env: &dyn Fn(&str) -> Option<String>) -> std::result::Result<String, String> {
    let a = env("MASTER_ADDR").ok_or("MASTER_ADDR is not set (the address of process 0)")?;
    let p = env("MASTER_PORT").ok_or("MASTER_PORT is not set (a free TCP port on process 0's host)")?;
    Ok(format!("{a}:{p}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
    }

    #[test]
    fn every_process_gets_the_id_from_process_0_on_loopback() {
        let addr = format!("127.0.0.1:{}", free_port());
        let id: Vec<u8> = (0..128u8).collect();
        let out: Vec<Vec<u8>> = std::thread::scope(|s| {
            // Peers start first: they must wait for process 0 to listen.
            let hs: Vec<_> = (1..4).map(|r| {
                let addr = addr.clone();
                s.spawn(move || rendezvous(&addr, r, 4, 8, None, Duration::from_secs(20)).unwrap())
            }).collect();
            std::thread::sleep(Duration::from_millis(200));
            let mine = rendezvous(&addr, 0, 4, 8, Some(&id), Duration::from_secs(20)).unwrap();
            std::iter::once(mine).chain(hs.into_iter().map(|h| h.join().unwrap())).collect()
        });
        assert!(out.iter().all(|o| o == &id));
    }

    #[test]
    fn a_missing_process_is_a_timeout_naming_it() {
        let addr = format!("127.0.0.1:{}", free_port());
        let (host, peer) = std::thread::scope(|s| {
            let a = addr.clone();
            let p = s.spawn(move || rendezvous(&a, 1, 3, 3, None, Duration::from_secs(1)));
            let h = rendezvous(&addr, 0, 3, 3, Some(b"id"), Duration::from_secs(1));
            (h, p.join().unwrap())
        });
        let e = host.unwrap_err().to_string();
        assert!(e.contains("[2] never arrived"), "{e}");
        let e = peer.unwrap_err().to_string();
        assert!(e.contains("refused") && e.contains("never arrived"), "{e}");
    }

    #[test]
    fn a_different_world_size_is_refused_with_both_numbers() {
        let addr = format!("127.0.0.1:{}", free_port());
        let (host, peer) = std::thread::scope(|s| {
            let a = addr.clone();
            let p = s.spawn(move || rendezvous(&a, 1, 3, 3, None, Duration::from_secs(10)));
            let h = rendezvous(&addr, 0, 2, 2, Some(b"id"), Duration::from_secs(10));
            (h, p.join().unwrap())
        });
        assert!(host.unwrap_err().to_string().contains("WORLD_SIZE=3, process 0 says 2"));
        assert!(peer.unwrap_err().to_string().contains("WORLD_SIZE=3"));
    }

    #[test]
    fn processes_that_count_ranks_differently_are_refused() {
        let addr = format!("127.0.0.1:{}", free_port());
        let (host, peer) = std::thread::scope(|s| {
            let a = addr.clone();
            let p = s.spawn(move || rendezvous(&a, 1, 2, 6, None, Duration::from_secs(10)));
            let h = rendezvous(&addr, 0, 2, 4, Some(b"id"), Duration::from_secs(10));
            (h, p.join().unwrap())
        });
        let e = host.unwrap_err().to_string();
        assert!(e.contains("counts 6 ranks, process 0 counts 4"), "{e}");
        assert!(peer.unwrap_err().to_string().contains("dist.devices"));
    }
}
