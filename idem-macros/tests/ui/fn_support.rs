//! Shared by the UI cases of plain functions (`fn_*`): a message, an output, and an error type
//! that takes the engine's errors.
#![allow(dead_code)]

use idem_runtime::function::OnceError;

#[derive(serde::Serialize)]
pub struct ChargeMessage {
    pub id: String,
    pub user: u64,
    pub amount: u32,
}

#[derive(serde::Serialize, serde::Deserialize)]
pub struct Receipt {
    pub amount: u32,
}

#[derive(Debug)]
pub enum ChargeError {
    Idem(OnceError),
}

impl From<OnceError> for ChargeError {
    fn from(e: OnceError) -> Self {
        ChargeError::Idem(e)
    }
}
