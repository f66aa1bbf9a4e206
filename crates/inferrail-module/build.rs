//! Links the module with every symbol bound at load (`-z now`): an Envoy
//! that lacks a callback the module calls refuses to load it, naming the
//! symbol, instead of failing on the first request that calls it.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,now");
}
