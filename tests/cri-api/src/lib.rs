//! The Kubernetes Container Runtime Interface (`runtime.v1`): messages and
//! the `RuntimeService` and `ImageService` clients, generated from
//! Kubernetes' `api.proto` at build time.

#![allow(clippy::all, clippy::pedantic, missing_docs)]

tonic::include_proto!("runtime.v1");
