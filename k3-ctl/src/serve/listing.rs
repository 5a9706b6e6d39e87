//! What `k3-ctl ps` is told: serve listens on `serve-PID.sock` in the store's socket directory
//! (private to the user) and answers [`ServeQuery::List`] with its requests, queued (with their
//! position) and running (with their worker), in the typed protocol of [`k3_proto::serve`].

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use k3_proto::serve::{
    listing_socket_name, ServeAnswer, ServeListing, ServeQuery, JOB_PROTOCOL_VERSION,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixListener;

use super::http::AppState;

/// How long an asker has to send its query.
const QUERY_TIMEOUT: Duration = Duration::from_secs(2);
/// Largest query read.
const MAX_QUERY: u32 = 4096;

/// The listing socket; removed when dropped.
#[derive(Debug)]
pub struct Listing {
    path: PathBuf,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Listing {
    fn drop(&mut self) {
        self.task.abort();
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Why the listing socket is not there (`k3-ctl ps` will not list this server; not fatal).
#[derive(Debug, thiserror::Error)]
pub enum ListingError {
    /// The store's socket path has no directory.
    #[error("{} has no directory", .0.display())]
    NoDir(std::path::PathBuf),
    /// The listing socket cannot be bound.
    #[error("{}: {source}", path.display())]
    Bind {
        /// The listing socket.
        path: std::path::PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// Listen beside the store's `socket`.
pub fn start(
    socket: &Path,
    st: Arc<AppState>,
    listen: SocketAddr,
    max_jobs: usize,
    queue: usize,
) -> Result<Listing, ListingError> {
    let dir = (socket.parent()).ok_or_else(|| ListingError::NoDir(socket.to_path_buf()))?;
    let path = dir.join(listing_socket_name(std::process::id()));
    // A socket of a dead process that had our pid.
    let _ = std::fs::remove_file(&path);
    let l = UnixListener::bind(&path).map_err(|source| ListingError::Bind {
        path: path.clone(),
        source,
    })?;
    {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600));
    }
    let n = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
    let base = ServeListing {
        pid: std::process::id(),
        listen: listen.to_string(),
        max_jobs: n(max_jobs),
        queue: n(queue),
        requests: Vec::new(),
    };
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            let st = st.clone();
            let base = base.clone();
            tokio::spawn(async move {
                let q = tokio::time::timeout(QUERY_TIMEOUT, read_query(&mut s)).await;
                let answer = match q {
                    Ok(Ok(ServeQuery::List { protocol_version })) if protocol_version == JOB_PROTOCOL_VERSION => {
                        ServeAnswer::List(ServeListing {
                            requests: st.admission.listing(),
                            ..base
                        })
                    }
                    Ok(Ok(ServeQuery::List { protocol_version })) => ServeAnswer::Refused {
                        serve_version: JOB_PROTOCOL_VERSION,
                        reason: format!(
                            "this server speaks v{JOB_PROTOCOL_VERSION}, the asker v{protocol_version}"
                        ),
                    },
                    _ => return,
                };
                if let Ok(f) = k3_proto::wire::encode(&answer) {
                    let _ = s.write_all(&f).await;
                }
            });
        }
    });
    Ok(Listing { path, task })
}

async fn read_query(s: &mut tokio::net::UnixStream) -> Result<ServeQuery, super::job::FrameError> {
    use super::job::FrameError;
    let mut len = [0u8; 4];
    s.read_exact(&mut len).await?;
    let len = u32::from_le_bytes(len);
    if len > MAX_QUERY {
        return Err(FrameError::TooLong {
            len,
            limit: MAX_QUERY,
        });
    }
    let mut body = vec![0u8; len as usize];
    s.read_exact(&mut body).await?;
    Ok(k3_proto::wire::decode(&body)?)
}
