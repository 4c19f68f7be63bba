use dspark_runtime::*;
fn main() {
    let p = std::path::PathBuf::from(std::env::args().nth(1).unwrap());
    let g = gguf::GgufFile::open(&p).unwrap();
    println!("{:?}", config::ModelConfig::from_gguf(&g).unwrap());
    let tok = Tokenizer::from_gguf(&g).unwrap();
    let ct = chat::ChatTemplate::from_tokenizer(&tok).unwrap();
    let s = ct
        .render(
            &[chat::Message::new("user", "What is the capital of France?")],
            true,
        )
        .unwrap();
    println!("{s:?}");
    let ids = tok.encode(&s).unwrap();
    println!("{ids:?}");
    let mut names: Vec<_> = g
        .content
        .tensor_infos
        .iter()
        .map(|(k, v)| format!("{k} {:?} {:?}", v.ggml_dtype, v.shape))
        .collect();
    names.sort();
    for n in names.iter().take(14) {
        println!("{n}");
    }
}
