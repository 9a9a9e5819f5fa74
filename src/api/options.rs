//! `PJRT_Client_Create` options, parsed and validated.
use crate::status::{invalid_argument, Result};

#[derive(Clone, Debug, PartialEq)]
pub enum OptionValue {
    Str(String),
    Int(i64),
    IntList(Vec<i64>),
    Float(f32),
    Bool(bool),
}

impl OptionValue {
    fn type_name(&self) -> &'static str {
        match self {
            OptionValue::Str(_) => "string",
            OptionValue::Int(_) => "int64",
            OptionValue::IntList(_) => "int64 list",
            OptionValue::Float(_) => "float",
            OptionValue::Bool(_) => "bool",
        }
    }
}

pub const MAX_DEVICES: i64 = 64;

#[derive(Clone, Debug, PartialEq)]
pub struct ClientOptions {
    /// Addressable devices of this process (host backend).
    pub num_devices: usize,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions { num_devices: 2 }
    }
}

const CONTEXT: &str = "PJRT_Client_Create";

fn expect_int(name: &str, value: &OptionValue) -> Result<i64> {
    match value {
        OptionValue::Int(v) => Ok(*v),
        other => Err(invalid_argument(format!(
            "{CONTEXT}: create option '{name}' must be int64, got {}",
            other.type_name()
        ))),
    }
}

impl ClientOptions {
    pub fn parse(options: &[(String, OptionValue)]) -> Result<ClientOptions> {
        let mut parsed = ClientOptions::default();
        let mut unknown = Vec::new();
        for (name, value) in options {
            match name.as_str() {
                "num_devices" => {
                    let n = expect_int(name, value)?;
                    if !(1..=MAX_DEVICES).contains(&n) {
                        return Err(invalid_argument(format!(
                            "{CONTEXT}: create option 'num_devices' must be in 1..={MAX_DEVICES}, got {n}"
                        )));
                    }
                    parsed.num_devices = n as usize;
                }
                _ => unknown.push(name.clone()),
            }
        }
        if !unknown.is_empty() {
            return Err(invalid_argument(format!(
                "{CONTEXT}: unknown create option(s) {unknown:?}; known: num_devices"
            )));
        }
        Ok(parsed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_options_are_named_in_the_error() {
        let err = ClientOptions::parse(&[("bogus".into(), OptionValue::Int(1))]).unwrap_err();
        assert!(err.message.contains("bogus"), "{}", err.message);
    }

    #[test]
    fn num_devices_is_range_and_type_checked() {
        let ok = ClientOptions::parse(&[("num_devices".into(), OptionValue::Int(4))]).unwrap();
        assert_eq!(ok.num_devices, 4);
        assert!(ClientOptions::parse(&[("num_devices".into(), OptionValue::Int(0))]).is_err());
        assert!(
            ClientOptions::parse(&[("num_devices".into(), OptionValue::Str("2".into()))]).is_err()
        );
    }
}
