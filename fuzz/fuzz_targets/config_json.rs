//! `config.json` (proto/src/config.rs): any bytes give a config or an error, and an accepted
//! config's derived values are computable without panicking.
#![no_main]

use k3_proto::config::ModelConfig;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(cfg) = ModelConfig::from_json_str(text) {
        let n = cfg.num_hidden_layers;
        for l in 0..n.min(4096) {
            let _ = cfg.layer_kind(l);
            let _ = cfg.is_moe(l);
        }
        let _ = cfg.layer_map();
        let _ = (cfg.n_mla(), cfg.n_kda(), cfg.n_moe());
        let _ = cfg.expert_layout();
        let _ = cfg.with_layers(n.min(1));
    }
});
