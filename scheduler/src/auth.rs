//! The shared cluster token (`--cluster-token`, `DSPARK_CLUSTER_TOKEN`): when it is set, every
//! gRPC server ([`crate::grpc_server`]) answers only calls that carry
//! `authorization: Bearer TOKEN`, and every client the binaries create sends it
//! ([`ClusterAuth`]). Without a token nothing is checked (the NetworkPolicies are all there is).
//!
//! It covers the scheduler, target and draft worker services; etcd registration and the
//! tensor-parallel rank links are not behind it.

use std::sync::Arc;
use tonic::metadata::AsciiMetadataValue;
use tonic::service::interceptor::InterceptedService;
use tonic::service::{Interceptor, InterceptorLayer};
use tonic::transport::Channel;

/// Where the token comes from when the flag is not given.
pub const TOKEN_ENV: &str = "DSPARK_CLUSTER_TOKEN";

/// Shortest token accepted: 16 bytes (a guessable token protects nothing).
pub const MIN_TOKEN_BYTES: usize = 16;

/// What a call without the token (or with a wrong one) is answered.
pub const UNAUTHENTICATED: &str = "this cluster requires its token (DSPARK_CLUSTER_TOKEN)";

/// `--cluster-token` checked: at least [`MIN_TOKEN_BYTES`] bytes, each visible ASCII (no
/// spaces: it travels in a header). The error never quotes the token.
pub fn check_token(token: &str) -> Result<(), String> {
    if token.len() < MIN_TOKEN_BYTES {
        return Err(format!(
            "--cluster-token ({TOKEN_ENV}) must be at least {MIN_TOKEN_BYTES} bytes, not {}",
            token.len()
        ));
    }
    if let Some(i) = token.bytes().position(|b| !b.is_ascii_graphic()) {
        return Err(format!(
            "--cluster-token ({TOKEN_ENV}) takes visible ASCII only (byte {i} is not)"
        ));
    }
    Ok(())
}

/// `--cluster-token` checked ([`check_token`]), ready for [`crate::grpc_server`].
pub fn cluster_token(arg: Option<&str>) -> Result<Option<Arc<str>>, String> {
    arg.map(|t| check_token(t).map(|()| Arc::from(t)))
        .transpose()
}

/// `a == b` in a time that depends on their lengths only, not on where they first differ: a
/// caller timing answers cannot find the token a byte at a time. (A length mismatch answers at
/// once; the length alone does not give the token away.)
pub fn same_token(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

/// The server side: refuses calls without `authorization: Bearer TOKEN` when a token is set,
/// lets everything through otherwise.
#[derive(Clone, Default)]
pub struct ClusterGate(Option<Arc<str>>);

impl ClusterGate {
    pub fn new(token: Option<Arc<str>>) -> Self {
        Self(token)
    }
}

impl std::fmt::Debug for ClusterGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let on = if self.0.is_some() { "token" } else { "open" };
        f.debug_tuple("ClusterGate").field(&on).finish()
    }
}

impl Interceptor for ClusterGate {
    fn call(&mut self, req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let Some(token) = &self.0 else {
            return Ok(req);
        };
        let got = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if got.is_some_and(|g| same_token(g.as_bytes(), token.as_bytes())) {
            Ok(req)
        } else {
            Err(tonic::Status::unauthenticated(UNAUTHENTICATED))
        }
    }
}

/// The layer [`crate::grpc_server`] puts in front of every service.
pub type GateLayer = InterceptorLayer<ClusterGate>;

/// The client side: adds `authorization: Bearer TOKEN` to every call when a token is set.
#[derive(Clone, Default)]
pub struct ClusterAuth(Option<Arc<AsciiMetadataValue>>);

impl ClusterAuth {
    /// Checks the token ([`check_token`]) and builds the header once.
    pub fn new(token: Option<&str>) -> Result<Self, String> {
        let Some(t) = token else {
            return Ok(Self(None));
        };
        check_token(t)?;
        let mut v: AsciiMetadataValue = format!("Bearer {t}")
            .parse()
            .map_err(|_| format!("--cluster-token ({TOKEN_ENV}) is not a valid header value"))?;
        v.set_sensitive(true);
        Ok(Self(Some(Arc::new(v))))
    }

    /// Whether calls carry a token.
    pub fn is_set(&self) -> bool {
        self.0.is_some()
    }

    /// `ch` with this interceptor in front, for a generated client's `new`.
    pub fn channel(&self, ch: Channel) -> AuthChannel {
        InterceptedService::new(ch, self.clone())
    }
}

impl std::fmt::Debug for ClusterAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let on = if self.0.is_some() { "token" } else { "none" };
        f.debug_tuple("ClusterAuth").field(&on).finish()
    }
}

impl Interceptor for ClusterAuth {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut()
                .insert("authorization", AsciiMetadataValue::clone(v));
        }
        Ok(req)
    }
}

/// A channel whose calls carry the cluster token ([`ClusterAuth`]).
pub type AuthChannel = InterceptedService<Channel, ClusterAuth>;

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "0123456789abcdef0123";

    #[test]
    fn same_token_compares_whole_values() {
        assert!(same_token(b"abcdefgh", b"abcdefgh"));
        assert!(!same_token(b"abcdefgh", b"abcdefgx"));
        assert!(!same_token(b"xbcdefgh", b"abcdefgh"));
        assert!(!same_token(b"abcdefgh", b"abcdefg"));
        assert!(!same_token(b"", b"a"));
        assert!(same_token(b"", b""));
    }

    #[test]
    fn tokens_are_long_visible_ascii() {
        assert!(check_token(TOKEN).is_ok());
        assert!(check_token(&"x".repeat(MIN_TOKEN_BYTES)).is_ok());
        let short = check_token(&"x".repeat(MIN_TOKEN_BYTES - 1)).unwrap_err();
        assert!(short.contains("at least 16 bytes"), "{short}");
        assert!(check_token("").is_err());
        assert!(check_token("0123456789 abcdef").is_err());
        assert!(check_token("0123456789abcdef\n").is_err());
        assert!(check_token("0123456789abcdéf").is_err());
        // The error never carries the token.
        assert!(
            !check_token("secret secret secret")
                .unwrap_err()
                .contains("secret")
        );
        assert_eq!(cluster_token(None), Ok(None));
        assert_eq!(cluster_token(Some(TOKEN)).unwrap().as_deref(), Some(TOKEN));
        assert!(cluster_token(Some("short")).is_err());
        assert!(ClusterAuth::new(Some("short")).is_err());
    }

    fn call(gate: &mut ClusterGate, header: Option<&str>) -> Result<(), tonic::Code> {
        let mut req = tonic::Request::new(());
        if let Some(h) = header {
            req.metadata_mut()
                .insert("authorization", h.parse().unwrap());
        }
        gate.call(req).map(|_| ()).map_err(|s| s.code())
    }

    #[test]
    fn the_gate_wants_the_token_when_one_is_set() {
        let mut open = ClusterGate::new(None);
        assert_eq!(call(&mut open, None), Ok(()));
        assert_eq!(call(&mut open, Some("Bearer whatever")), Ok(()));
        let mut gate = ClusterGate::new(Some(Arc::from(TOKEN)));
        let unauth = Err(tonic::Code::Unauthenticated);
        assert_eq!(call(&mut gate, None), unauth);
        assert_eq!(call(&mut gate, Some(TOKEN)), unauth);
        assert_eq!(call(&mut gate, Some("Bearer 0123456789abcdef0124")), unauth);
        assert_eq!(call(&mut gate, Some(&format!("Basic {TOKEN}"))), unauth);
        assert_eq!(call(&mut gate, Some(&format!("Bearer {TOKEN}"))), Ok(()));
        // What a client with the token sends passes; without it, nothing is added.
        let mut with = ClusterAuth::new(Some(TOKEN)).unwrap();
        let req = with.call(tonic::Request::new(())).unwrap();
        assert!(gate.call(req).is_ok());
        let mut without = ClusterAuth::default();
        let req = without.call(tonic::Request::new(())).unwrap();
        assert!(req.metadata().get("authorization").is_none());
        assert_eq!(format!("{with:?}"), "ClusterAuth(\"token\")");
    }
}
