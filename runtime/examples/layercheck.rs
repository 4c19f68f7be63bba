use dspark_runtime::model::*;
use dspark_runtime::*;
fn main() {
    let p = std::path::PathBuf::from(std::env::args().nth(1).unwrap());
    let tok = Tokenizer::load(&p).unwrap();
    let ct = chat::ChatTemplate::from_tokenizer(&tok).unwrap();
    let ids = tok
        .encode(
            &ct.render(
                &[chat::Message::new("user", "What is the capital of France?")],
                true,
            )
            .unwrap(),
        )
        .unwrap();
    let mut outs = vec![];
    for dense in [true, false] {
        let model = Model::load(
            &p,
            &LoadOptions {
                dense,
                ..Default::default()
            },
        )
        .unwrap();
        let mut c = model.new_cache(256, 16).unwrap();
        let s = c.new_seq();
        let o = model
            .forward(
                &mut c,
                &[SeqInput {
                    seq: s,
                    tokens: &ids,
                    logits: LogitsMode::All,
                }],
                &ForwardOptions {
                    hidden: true,
                    layers: (0..model.cfg.n_layers).collect(),
                },
            )
            .unwrap();
        outs.push(o);
    }
    let v = outs[0].vocab;
    for pos in 0..ids.len() {
        let a = &outs[0].logits[pos * v..(pos + 1) * v];
        let b = &outs[1].logits[pos * v..(pos + 1) * v];
        let mut pa = a.to_vec();
        kernels::ops::softmax(&mut pa);
        let mut pb = b.to_vec();
        kernels::ops::softmax(&mut pb);
        let kl: f32 = pa
            .iter()
            .zip(&pb)
            .map(|(x, y)| {
                if *x > 0.0 {
                    x * (x.max(1e-30).ln() - y.max(1e-30).ln())
                } else {
                    0.0
                }
            })
            .sum();
        if pos + 1 == ids.len() {
            for (nm, pp) in [("dense", &pa), ("quant", &pb)] {
                let mut ix: Vec<usize> = (0..v).collect();
                ix.sort_by(|x, y| pp[*y].total_cmp(&pp[*x]));
                println!(
                    "{nm}: {:?}",
                    ix[..5]
                        .iter()
                        .map(|&i| (i, pp[i], tok.token_str(i as u32)))
                        .collect::<Vec<_>>()
                );
            }
        }
        println!(
            "pos {pos}: top1 {} {} kl {kl:.4}",
            kernels::sampling::argmax(a),
            kernels::sampling::argmax(b)
        );
    }
    for l in 0..outs[0].layer_hidden.len() {
        let a = &outs[0].layer_hidden[l];
        let b = &outs[1].layer_hidden[l];
        let num: f32 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
        let den: f32 = a.iter().map(|x| x * x).sum();
        let maxa = a.iter().map(|x| x.abs()).fold(0f32, f32::max);
        println!(
            "layer {l}: rel err {:.4} max|h| {maxa:.1}",
            (num / den).sqrt()
        );
    }
}
#[allow(dead_code)]
fn unused() {}
