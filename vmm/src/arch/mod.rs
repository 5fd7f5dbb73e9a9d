//! Architecture support. husk runs x86_64 guests only.

pub mod x86_64;
