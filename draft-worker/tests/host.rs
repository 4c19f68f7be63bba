//! The draft worker hosting a trained DSpark drafter: what it advertises.

use clap::Parser;
use draft_worker::DraftArgs;
use draft_worker::drafting::{DraftHost, advertised_max_gamma};
use drafter::model::{DrafterConfig, DsparkDrafter, target_tensors};
use dspark_runtime::tiny::{TinySpec, tiny_model_path};
use dspark_runtime::{LoadOptions, Model, Tokenizer};

/// A drafter trained for γ = 3 is advertised with γ 3 (`WorkerInfo.max_gamma` is the host's),
/// not the protocol's longest block: a target worker asking it for longer blocks is refused
/// remotely as it is in process. A proposer without a trained γ drafts any length.
#[test]
fn the_advertised_gamma_is_the_drafters_trained_one() {
    let opts = LoadOptions {
        threads: 1,
        ..Default::default()
    };
    let p = tiny_model_path(&TinySpec::llama(41), "draft-host-gamma").unwrap();
    let m = Model::load(&p, &opts).unwrap();
    let tok = Tokenizer::load(&p).unwrap();
    let (e, h) = target_tensors(&m).unwrap();
    let mut cfg = DrafterConfig::for_target(&m.cfg, &tok.vocab_hash(), 3, 1, 16);
    cfg.feature_layers = vec![0, 1];
    cfg.context = 8;
    let dr = DsparkDrafter::new(cfg, e, h, 5).unwrap();
    let dir = std::env::temp_dir().join(format!("dspark-draft-host-{}", std::process::id()));
    dr.save(&dir).unwrap();
    let target = p.display().to_string();
    let kind = format!("dspark:{}", dir.display());
    let args = DraftArgs::parse_from([
        "draft-worker",
        "--target",
        target.as_str(),
        "--drafter",
        kind.as_str(),
        "--threads",
        "1",
    ]);
    let hub = drafter::build::ModelHub {
        home: std::env::temp_dir(),
        python: "python3".into(),
        opts,
    };
    let host = DraftHost::load(&hub, &args).unwrap();
    assert!(3 < specdec::MAX_GAMMA);
    assert_eq!(host.max_gamma, 3);
    assert_eq!(
        advertised_max_gamma(&specdec::proposer::NgramProposer::default()),
        specdec::MAX_GAMMA
    );
    std::fs::remove_dir_all(&dir).ok();
}
