use dspark_runtime::generate::*;
use dspark_runtime::*;
fn main() {
    let p = std::path::PathBuf::from(std::env::args().nth(1).unwrap());
    let dense = std::env::args().nth(2).as_deref() == Some("dense");
    let isa = std::env::args()
        .nth(3)
        .map(|s| kernels::Isa::parse(&s).unwrap());
    let model = Model::load(
        &p,
        &LoadOptions {
            dense,
            isa,
            ..Default::default()
        },
    )
    .unwrap();
    let tok = Tokenizer::load(&p).unwrap();
    let ct = chat::ChatTemplate::from_tokenizer(&tok).unwrap();
    let s = ct
        .render(
            &[chat::Message::new("user", "What is the capital of France?")],
            true,
        )
        .unwrap();
    let ids = tok.encode(&s).unwrap();
    let out = generate(
        &model,
        &tok,
        &ids,
        &GenerateParams {
            max_tokens: 20,
            ..Default::default()
        },
        &mut |_| {},
    )
    .unwrap();
    println!("{:?} {:?}", out.text, &out.token_ids);
}
