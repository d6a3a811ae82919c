// Cargo only resolves a package's build dependencies when it has a build script.
fn main() {}
