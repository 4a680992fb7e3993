//! One parse for two readers: the handler's `Json<T>` and the fingerprint's canonical form.
//!
//! A keyed JSON request was parsed twice: once to write the fingerprint's canonical form
//! ([`Canonical`]), once more by the handler's `Json<T>` extractor. Here `T` is deserialized from
//! serde_json as the extractor would, through a deserializer that stands between the two ([`Tee`]):
//! every call `T`'s `Deserialize` makes is passed on to serde_json unchanged, and every value
//! serde_json reports on its way back to `T`'s visitor is also written into the canonical form,
//! exactly where [`Write`] would write it. The fingerprint is then hashed from that form.
//!
//! Three rules keep this exact:
//!
//! - **`T`'s value is serde_json's.** Calls are forwarded as they are, with two exceptions that
//!   reproduce serde_json's behaviour by other means because its own way would hide the value from
//!   the form: a value `T` ignores is parsed instead of skipped, then reported as serde_json
//!   reports it (`visit_unit`); an enum is read through `deserialize_any` and handed to `T`'s
//!   visitor as serde_json's two enum forms (a string, or an object of one member) would hand it.
//! - **An error anywhere refuses the parse.** An error that passes through the tee, whether
//!   serde_json's or `T`'s own, refuses it even if `T`'s `Deserialize` swallows it and goes on (a
//!   lenient field): serde_json may have consumed a value the form never got, or, past an enum
//!   read through `deserialize_any`, one serde_json would not have consumed. So does whatever the
//!   tee cannot reproduce (a variant's name read other than as a string, an enum visitor that
//!   returns without reading it), and a panic that `T`'s code caught after it unwound through the
//!   tee (a call out that never returned). The caller then runs `Json<T>` itself on the same bytes
//!   ([`crate::axum`]): a refusal costs the second parse (and runs `T`'s `Deserialize` twice),
//!   never a different value.
//! - **The form is [`Write`]'s, or none.** Values reported in a shape `Write` never sees (an `f32`
//!   or 128-bit integer parsed at `T`'s request, raw bytes, an object key read as a number, a
//!   `RawValue`) make the parse *unsure*: `T` is still returned, and the fingerprint is computed
//!   by [`Fingerprint::of_request`] from the bytes, as before.
//!
//! `tests` compares both halves, value and fingerprint, with `serde_json::from_slice` and
//! [`Fingerprint::of_request`] over typed and untyped documents of every shape.

use super::{is_json, with_scratch, Canonical, Fingerprint, KeyWritten, Opened, Write};
use serde::de::{
    self, DeserializeOwned, DeserializeSeed, Deserializer, EnumAccess, MapAccess, SeqAccess,
    VariantAccess, Visitor,
};
use sha2::Digest;
use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

/// Deserializes `T` from a JSON `body`, as `axum::Json<T>` does (`serde_json::from_slice`, then
/// nothing but whitespace after the value), and fingerprints the request in the same parse.
/// `None` if `T` does not deserialize from the body (or not in a way this module reproduces): the
/// caller then extracts as if this did not exist.
pub(crate) fn of_json_request<T: DeserializeOwned>(
    method: &str,
    path: &str,
    content_type: Option<&str>,
    body: &[u8],
) -> Option<(T, Fingerprint)> {
    let (value, fingerprint) = if content_type.is_some_and(is_json) && numbers_are_plain() {
        parse(method, path, body)?
    } else {
        (serde_json::from_slice(body).ok()?, None)
    };
    let fingerprint =
        fingerprint.unwrap_or_else(|| Fingerprint::of_request(method, path, content_type, body));
    Some((value, fingerprint))
}

/// `T` from a JSON body and, unless the parse was unsure, the request's fingerprint.
fn parse<T: DeserializeOwned>(
    method: &str,
    path: &str,
    body: &[u8],
) -> Option<(T, Option<Fingerprint>)> {
    with_scratch(|canon| {
        canon.start(body.len());
        let mut parser = serde_json::Deserializer::from_slice(body);
        let value = T::deserialize(Tee::value(&mut parser, canon)).ok()?;
        parser.end().ok()?;
        // An error that `T`'s `Deserialize` swallowed: serde_json may have consumed what the form
        // never got (or, past an enum read differently, not have consumed it).
        if canon.refused || canon.handed_off != 0 {
            return None;
        }
        // Nothing written: `T` never read the body (an empty body, or a `Deserialize` that
        // ignores its input), which `Write` would call no JSON at all.
        let fingerprint = (!canon.unsure && !canon.out.is_empty()).then(|| {
            let mut h = Fingerprint::hasher(method, path);
            canon.finish(&mut h);
            Fingerprint(h.finalize().into())
        });
        Some((value, fingerprint))
    })
}

/// Whether serde_json reports numbers as numbers. A crate in the build that turns on serde_json's
/// `arbitrary_precision` makes `deserialize_any` report each number as a one-member map, where a
/// typed field still receives a number: the two forms would then differ, so the tee stands aside.
fn numbers_are_plain() -> bool {
    static PLAIN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PLAIN.get_or_init(|| {
        struct IsNumber;
        impl<'de> Visitor<'de> for IsNumber {
            type Value = bool;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a number")
            }
            fn visit_u64<E>(self, _: u64) -> Result<bool, E> {
                Ok(true)
            }
            fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<bool, A::Error> {
                Ok(false)
            }
        }
        serde_json::Deserializer::from_slice(b"1")
            .deserialize_any(IsNumber)
            .unwrap_or(false)
    })
}

/// Where the value being read sits: a value, or the key of a member of `Opened`.
#[derive(Debug, Clone, Copy)]
enum Role {
    Value,
    Key(Opened),
}

/// A deserializer that passes every call on to `de` and writes what comes back into `canon`.
struct Tee<'c, D> {
    de: D,
    canon: &'c mut Canonical,
    role: Role,
}

impl<'c, D> Tee<'c, D> {
    fn value(de: D, canon: &'c mut Canonical) -> Self {
        Tee {
            de,
            canon,
            role: Role::Value,
        }
    }
}

impl Canonical {
    /// `result`, the parse refused if it is an error: `T`'s `Deserialize` may swallow it and go
    /// on, past a value serde_json consumed and the form never got.
    fn noted<T, E>(&mut self, result: Result<T, E>) -> Result<T, E> {
        if result.is_err() {
            self.refused = true;
        }
        result
    }

    /// Hands control to serde_json or to `T`'s code for `f`, and [notes](Self::noted) what comes
    /// back. `T`'s code may also catch a panic that unwinds through here, past the form's
    /// bookkeeping: a hand-off that never came back is still counted in `handed_off`, which
    /// refuses the parse.
    fn hand_off<T, E>(&mut self, f: impl FnOnce(&mut Self) -> Result<T, E>) -> Result<T, E> {
        self.handed_off += 1;
        let result = f(self);
        self.handed_off -= 1;
        self.noted(result)
    }
}

/// Passes the call on, the visitor wrapped, and notes an error.
macro_rules! forward {
    ($($method:ident($($arg:ident: $ty:ty),*);)*) => {$(
        fn $method<V: Visitor<'de>>(self, $($arg: $ty,)* visitor: V) -> Result<V::Value, D::Error> {
            let Tee { de, canon, role } = self;
            canon.hand_off(|canon| de.$method($($arg,)* TeeVisitor { visitor, canon, role }))
        }
    )*};
}

/// [`forward!`], after marking the parse unsure: serde_json answers these calls in shapes `Write`
/// never sees.
macro_rules! forward_unsure {
    ($($method:ident($($arg:ident: $ty:ty),*);)*) => {$(
        fn $method<V: Visitor<'de>>(self, $($arg: $ty,)* visitor: V) -> Result<V::Value, D::Error> {
            let Tee { de, canon, role } = self;
            canon.unsure = true;
            canon.hand_off(|canon| de.$method($($arg,)* TeeVisitor { visitor, canon, role }))
        }
    )*};
}

impl<'de, D: Deserializer<'de>> Deserializer<'de> for Tee<'_, D> {
    type Error = D::Error;

    forward! {
        deserialize_any();
        deserialize_bool();
        deserialize_i8();
        deserialize_i16();
        deserialize_i32();
        deserialize_i64();
        deserialize_u8();
        deserialize_u16();
        deserialize_u32();
        deserialize_u64();
        deserialize_f64();
        deserialize_char();
        deserialize_str();
        deserialize_string();
        deserialize_option();
        deserialize_unit();
        deserialize_unit_struct(name: &'static str);
        deserialize_seq();
        deserialize_tuple(len: usize);
        deserialize_tuple_struct(name: &'static str, len: usize);
        deserialize_map();
        deserialize_struct(name: &'static str, fields: &'static [&'static str]);
        deserialize_identifier();
    }

    forward_unsure! {
        // Parsed at single precision, or into 128 bits, where `Write` has the `f64` or `u64`.
        deserialize_f32();
        deserialize_i128();
        deserialize_u128();
        // The string's bytes as parsed, which `Write` never sees.
        deserialize_bytes();
        deserialize_byte_buf();
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        let Tee { de, canon, role } = self;
        // serde_json's own newtypes (`RawValue`) read the raw text, not values.
        if name.starts_with("$serde_json::") {
            canon.unsure = true;
        }
        canon.hand_off(|canon| {
            de.deserialize_newtype_struct(
                name,
                TeeVisitor {
                    visitor,
                    canon,
                    role,
                },
            )
        })
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        let Tee { de, canon, role } = self;
        match role {
            Role::Value => canon.hand_off(|canon| de.deserialize_any(EnumForm { visitor, canon })),
            // A key is always the string form; its variant is not written as a key.
            Role::Key(_) => {
                canon.unsure = true;
                canon.hand_off(|canon| {
                    de.deserialize_enum(
                        name,
                        variants,
                        TeeVisitor {
                            visitor,
                            canon,
                            role,
                        },
                    )
                })
            }
        }
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, D::Error> {
        let Tee { de, canon, role } = self;
        match role {
            // serde_json skips the value and reports a unit; it is parsed here instead, so that
            // what `T` ignores is fingerprinted too.
            Role::Value => canon.hand_off(|canon| match de.deserialize_any(Write(canon)) {
                Ok(()) => visitor.visit_unit(),
                Err(e) => Err(e),
            }),
            Role::Key(_) => canon.hand_off(|canon| {
                de.deserialize_ignored_any(TeeVisitor {
                    visitor,
                    canon,
                    role,
                })
            }),
        }
    }

    fn is_human_readable(&self) -> bool {
        self.de.is_human_readable()
    }
}

/// `T`'s visitor, shown what serde_json shows it after the value is written.
struct TeeVisitor<'c, V> {
    visitor: V,
    canon: &'c mut Canonical,
    role: Role,
}

impl<'c, V> TeeVisitor<'c, V> {
    /// A scalar: written as a value, unsure as a key (keys are strings).
    fn scalar<T: serde::Serialize + ?Sized>(&mut self, value: &T) {
        match self.role {
            Role::Value => self.canon.scalar(value),
            Role::Key(_) => self.canon.unsure = true,
        }
    }

    /// A string: a value, or the key of the next member.
    fn string(&mut self, value: Cow<'_, str>) {
        match self.role {
            Role::Value => {
                self.canon.string(&value);
            }
            Role::Key(object) => {
                self.canon.pending_key = Some(self.canon.member_key(object, value))
            }
        }
    }

    /// What `Write` never sees.
    fn unsure(&mut self) {
        self.canon.unsure = true;
    }

    fn null(&mut self) {
        match self.role {
            Role::Value => self.canon.out.extend_from_slice(b"null"),
            Role::Key(_) => self.canon.unsure = true,
        }
    }

    /// The visitor, and `de` wrapped in this visitor's role (`visit_some`, `visit_newtype_struct`).
    fn inner<D>(self, de: D) -> (V, Tee<'c, D>) {
        let inner = Tee {
            de,
            canon: self.canon,
            role: self.role,
        };
        (self.visitor, inner)
    }
}

/// `TeeVisitor`'s visits of one value each: written as a scalar, or marking the parse unsure;
/// either way passed on to `T`'s visitor unchanged.
macro_rules! visit {
    (scalar: $($scalar:ident($sty:ty)),*; unsure: $($unsure:ident($uty:ty)),*;) => {
        $(fn $scalar<E: de::Error>(mut self, v: $sty) -> Result<V::Value, E> {
            self.scalar(&v);
            self.visitor.$scalar(v)
        })*
        $(fn $unsure<E: de::Error>(mut self, v: $uty) -> Result<V::Value, E> {
            self.unsure();
            self.visitor.$unsure(v)
        })*
    };
}

impl<'de, V: Visitor<'de>> Visitor<'de> for TeeVisitor<'_, V> {
    type Value = V::Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.visitor.expecting(f)
    }
    visit! {
        scalar: visit_bool(bool), visit_i64(i64), visit_u64(u64), visit_f64(f64);
        // serde_json calls none of these on a value it reports: passed on, unsure.
        unsure: visit_i8(i8), visit_i16(i16), visit_i32(i32), visit_i128(i128), visit_u8(u8),
            visit_u16(u16), visit_u32(u32), visit_u128(u128), visit_f32(f32), visit_char(char),
            visit_bytes(&[u8]), visit_borrowed_bytes(&'de [u8]), visit_byte_buf(Vec<u8>);
    }
    fn visit_str<E: de::Error>(mut self, v: &str) -> Result<V::Value, E> {
        self.string(Cow::Borrowed(v));
        self.visitor.visit_str(v)
    }
    fn visit_borrowed_str<E: de::Error>(mut self, v: &'de str) -> Result<V::Value, E> {
        self.string(Cow::Borrowed(v));
        self.visitor.visit_borrowed_str(v)
    }
    fn visit_string<E: de::Error>(mut self, v: String) -> Result<V::Value, E> {
        self.string(Cow::Borrowed(&v));
        self.visitor.visit_string(v)
    }
    fn visit_unit<E: de::Error>(mut self) -> Result<V::Value, E> {
        self.null();
        self.visitor.visit_unit()
    }
    fn visit_none<E: de::Error>(mut self) -> Result<V::Value, E> {
        self.null();
        self.visitor.visit_none()
    }
    fn visit_some<D: Deserializer<'de>>(self, de: D) -> Result<V::Value, D::Error> {
        let (visitor, inner) = self.inner(de);
        visitor.visit_some(inner)
    }
    fn visit_newtype_struct<D: Deserializer<'de>>(self, de: D) -> Result<V::Value, D::Error> {
        let (visitor, inner) = self.inner(de);
        visitor.visit_newtype_struct(inner)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<V::Value, A::Error> {
        let TeeVisitor {
            visitor,
            canon,
            role,
        } = self;
        if let Role::Key(_) = role {
            canon.unsure = true;
        }
        canon.out.push(b'[');
        let value = visitor.visit_seq(TeeSeq {
            seq,
            canon: &mut *canon,
            first: true,
        })?;
        canon.out.push(b']');
        Ok(value)
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<V::Value, A::Error> {
        let TeeVisitor {
            visitor,
            canon,
            role,
        } = self;
        if let Role::Key(_) = role {
            canon.unsure = true;
        }
        let object = canon.open_object();
        let value = visitor.visit_map(TeeMap {
            map,
            canon: &mut *canon,
            object,
            key: None,
        })?;
        canon.close_object(object);
        Ok(value)
    }

    fn visit_enum<A: EnumAccess<'de>>(mut self, data: A) -> Result<V::Value, A::Error> {
        self.unsure();
        self.visitor.visit_enum(data)
    }
}

/// Passes a seed on, its deserializer wrapped.
struct TeeSeed<'c, S> {
    seed: S,
    canon: &'c mut Canonical,
    role: Role,
}

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for TeeSeed<'_, S> {
    type Value = S::Value;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<S::Value, D::Error> {
        self.seed.deserialize(Tee {
            de,
            canon: self.canon,
            role: self.role,
        })
    }
}

/// An array's elements, each written after its comma.
struct TeeSeq<'c, A> {
    seq: A,
    canon: &'c mut Canonical,
    first: bool,
}

impl<'de, A: SeqAccess<'de>> SeqAccess<'de> for TeeSeq<'_, A> {
    type Error = A::Error;

    fn next_element_seed<S: DeserializeSeed<'de>>(
        &mut self,
        seed: S,
    ) -> Result<Option<S::Value>, A::Error> {
        let before = self.canon.element(self.first);
        let seq = &mut self.seq;
        let element = self.canon.hand_off(|canon| {
            seq.next_element_seed(TeeSeed {
                seed,
                canon,
                role: Role::Value,
            })
        })?;
        match element {
            Some(_) => self.first = false,
            None => self.canon.out.truncate(before),
        }
        Ok(element)
    }

    fn size_hint(&self) -> Option<usize> {
        self.seq.size_hint()
    }
}

/// An object's members: each key written as a member's key, each member listed once its value is
/// written.
struct TeeMap<'c, A> {
    map: A,
    canon: &'c mut Canonical,
    object: Opened,
    /// The key just read, whose value comes next.
    key: Option<KeyWritten>,
}

impl<'de, A: MapAccess<'de>> MapAccess<'de> for TeeMap<'_, A> {
    type Error = A::Error;

    fn next_key_seed<S: DeserializeSeed<'de>>(
        &mut self,
        seed: S,
    ) -> Result<Option<S::Value>, A::Error> {
        let (map, role) = (&mut self.map, Role::Key(self.object));
        let key = self
            .canon
            .hand_off(|canon| map.next_key_seed(TeeSeed { seed, canon, role }))?;
        if key.is_some() {
            self.key = self.canon.pending_key.take();
            if self.key.is_none() {
                self.canon.unsure = true; // read as something other than a string
            }
        }
        Ok(key)
    }

    fn next_value_seed<S: DeserializeSeed<'de>>(&mut self, seed: S) -> Result<S::Value, A::Error> {
        let map = &mut self.map;
        let value = self.canon.hand_off(|canon| {
            map.next_value_seed(TeeSeed {
                seed,
                canon,
                role: Role::Value,
            })
        })?;
        if let Some(key) = self.key.take() {
            self.canon.member_end(key);
        }
        Ok(value)
    }

    fn size_hint(&self) -> Option<usize> {
        self.map.size_hint()
    }
}

/// An enum in value position, read as `deserialize_any` reports it (so that it is written) and
/// handed to `T`'s visitor in serde_json's two forms: `"Variant"`, or `{"Variant": value}`.
/// serde_json reads nothing else as an enum (and consumes nothing else then): anything else, or
/// a visitor that returns without reading the variant's name, refuses the parse.
struct EnumForm<'c, V> {
    visitor: V,
    canon: &'c mut Canonical,
}

impl<'de, V: Visitor<'de>> EnumForm<'_, V> {
    /// The string form: the name is written as a string, then handed to the visitor.
    fn unit<E: de::Error>(self, ident: Ident<'_, 'de>) -> Result<V::Value, E> {
        let name = match ident {
            Ident::Borrowed(name) | Ident::Copied(name) => name,
        };
        self.canon.scalar(name);
        let mut read = false;
        let value = self.visitor.visit_enum(UnitForm {
            ident,
            read: &mut read,
            error: PhantomData,
        });
        if !read {
            self.canon.refused = true;
        }
        self.canon.noted(value)
    }
}

impl<'de, V: Visitor<'de>> Visitor<'de> for EnumForm<'_, V> {
    type Value = V::Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.visitor.expecting(f)
    }
    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<V::Value, E> {
        self.unit(Ident::Borrowed(v))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<V::Value, E> {
        self.unit(Ident::Copied(v))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<V::Value, A::Error> {
        let EnumForm { visitor, canon } = self;
        let object = canon.open_object();
        let value = visitor.visit_enum(ObjectForm {
            map: &mut map,
            canon: &mut *canon,
            object,
        });
        // serde_json's enum object holds one member, read whole: past what the visitor read,
        // serde_json's own end of the object refuses anything but its `}` (a name or a value left
        // unread, a second member).
        canon.close_object(object);
        canon.noted(value)
    }
}

/// A variant's name as serde_json reads it, either borrowed from the body or decoded (escaped).
#[derive(Clone, Copy)]
enum Ident<'a, 'de> {
    Borrowed(&'de str),
    Copied(&'a str),
}

/// The name of a variant, read the only ways serde_json's enum forms read one: as a string (an
/// identifier, `str`, `string` or any), which sets `read`. Any other request is refused.
struct IdentDe<'a, 'de, 'f, E> {
    ident: Ident<'a, 'de>,
    read: &'f mut bool,
    error: PhantomData<E>,
}

/// Refuses the call: see [`IdentDe`].
macro_rules! refuse {
    ($($method:ident($($arg:ident: $ty:ty),*);)*) => {$(
        fn $method<V: Visitor<'de>>(self, $($arg: $ty,)* visitor: V) -> Result<V::Value, E> {
            let _ = ($($arg,)* visitor);
            Err(de::Error::custom("a variant name read other than as a string"))
        }
    )*};
}

impl<'de, E: de::Error> Deserializer<'de> for IdentDe<'_, 'de, '_, E> {
    type Error = E;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, E> {
        *self.read = true;
        match self.ident {
            Ident::Borrowed(v) => visitor.visit_borrowed_str(v),
            Ident::Copied(v) => visitor.visit_str(v),
        }
    }
    fn deserialize_identifier<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, E> {
        self.deserialize_any(visitor)
    }
    fn deserialize_str<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, E> {
        self.deserialize_any(visitor)
    }
    fn deserialize_string<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, E> {
        self.deserialize_any(visitor)
    }

    refuse! {
        deserialize_bool();
        deserialize_i8();
        deserialize_i16();
        deserialize_i32();
        deserialize_i64();
        deserialize_i128();
        deserialize_u8();
        deserialize_u16();
        deserialize_u32();
        deserialize_u64();
        deserialize_u128();
        deserialize_f32();
        deserialize_f64();
        deserialize_char();
        deserialize_bytes();
        deserialize_byte_buf();
        deserialize_option();
        deserialize_unit();
        deserialize_unit_struct(name: &'static str);
        deserialize_newtype_struct(name: &'static str);
        deserialize_seq();
        deserialize_tuple(len: usize);
        deserialize_tuple_struct(name: &'static str, len: usize);
        deserialize_map();
        deserialize_struct(name: &'static str, fields: &'static [&'static str]);
        deserialize_enum(name: &'static str, variants: &'static [&'static str]);
        deserialize_ignored_any();
    }
}

/// `"Variant"`: serde_json's unit form, whose variant may only be a unit. `read` is set once the
/// name is read whole.
struct UnitForm<'a, 'de, 'f, E> {
    ident: Ident<'a, 'de>,
    read: &'f mut bool,
    error: PhantomData<E>,
}

impl<'de, 'f, E: de::Error> EnumAccess<'de> for UnitForm<'_, 'de, 'f, E> {
    type Error = E;
    type Variant = UnitOnly<E>;

    fn variant_seed<S: DeserializeSeed<'de>>(self, seed: S) -> Result<(S::Value, UnitOnly<E>), E> {
        let mut named = false;
        let variant = seed.deserialize(IdentDe {
            ident: self.ident,
            read: &mut named,
            error: PhantomData,
        })?;
        *self.read = named;
        Ok((variant, UnitOnly(PhantomData)))
    }
}

/// The variant of [`UnitForm`]: a unit, as serde_json's string form allows (it consumes nothing
/// more, whatever is asked of it).
struct UnitOnly<E>(PhantomData<E>);

impl<'de, E: de::Error> VariantAccess<'de> for UnitOnly<E> {
    type Error = E;

    fn unit_variant(self) -> Result<(), E> {
        Ok(())
    }
    fn newtype_variant_seed<S: DeserializeSeed<'de>>(self, _: S) -> Result<S::Value, E> {
        Err(de::Error::invalid_type(
            de::Unexpected::UnitVariant,
            &"newtype variant",
        ))
    }
    fn tuple_variant<V: Visitor<'de>>(self, _: usize, _: V) -> Result<V::Value, E> {
        Err(de::Error::invalid_type(
            de::Unexpected::UnitVariant,
            &"tuple variant",
        ))
    }
    fn struct_variant<V: Visitor<'de>>(
        self,
        _: &'static [&'static str],
        _: V,
    ) -> Result<V::Value, E> {
        Err(de::Error::invalid_type(
            de::Unexpected::UnitVariant,
            &"struct variant",
        ))
    }
}

/// `{"Variant": value}`: serde_json's object form. The name is the member's key, read as a string
/// only; the value is read as serde_json's `VariantAccess` reads it.
struct ObjectForm<'m, 'c, A> {
    map: &'m mut A,
    canon: &'c mut Canonical,
    object: Opened,
}

impl<'de, 'm, 'c, A: MapAccess<'de>> EnumAccess<'de> for ObjectForm<'m, 'c, A> {
    type Error = A::Error;
    type Variant = ObjectVariant<'m, 'c, A>;

    fn variant_seed<S: DeserializeSeed<'de>>(
        self,
        seed: S,
    ) -> Result<(S::Value, Self::Variant), A::Error> {
        let ObjectForm { map, canon, object } = self;
        let name = canon.hand_off(|canon| {
            map.next_key_seed(VariantName {
                seed,
                canon,
                object,
            })
        });
        let Some(variant) = name? else {
            return canon.noted(Err(de::Error::invalid_length(
                0,
                &"an enum object of one member",
            )));
        };
        let Some(key) = canon.pending_key.take() else {
            return canon.noted(Err(de::Error::custom(
                "a variant name read other than as a string",
            )));
        };
        Ok((variant, ObjectVariant { map, canon, key }))
    }
}

/// Reads a variant's name from an object key as a string, written as the member's key, then hands
/// it to the seed as serde_json's object form would.
struct VariantName<'c, S> {
    seed: S,
    canon: &'c mut Canonical,
    object: Opened,
}

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for VariantName<'_, S> {
    type Value = S::Value;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<S::Value, D::Error> {
        /// The key as serde_json's key deserializer reads a string: borrowed, or decoded.
        struct AsName;
        impl<'de> Visitor<'de> for AsName {
            type Value = Cow<'de, str>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a variant name")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Cow::Borrowed(v))
            }
            fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Cow::Owned(v.to_owned()))
            }
        }
        let name = de.deserialize_str(AsName)?;
        let ident = match &name {
            Cow::Borrowed(v) => Ident::Borrowed(v),
            Cow::Owned(v) => Ident::Copied(v),
        };
        let mut named = false;
        let variant = self.seed.deserialize(IdentDe {
            ident,
            read: &mut named,
            error: PhantomData,
        })?;
        if named {
            self.canon.pending_key = Some(self.canon.member_key(self.object, name));
        }
        Ok(variant)
    }
}

/// The variant of [`ObjectForm`]: the member's value, read as serde_json's `VariantAccess` reads
/// each kind.
struct ObjectVariant<'m, 'c, A> {
    map: &'m mut A,
    canon: &'c mut Canonical,
    key: KeyWritten,
}

impl<'de, A: MapAccess<'de>> ObjectVariant<'_, '_, A> {
    fn value<S: DeserializeSeed<'de>>(self, seed: S) -> Result<S::Value, A::Error> {
        let map = self.map;
        let value = self.canon.hand_off(|canon| {
            map.next_value_seed(TeeSeed {
                seed,
                canon,
                role: Role::Value,
            })
        })?;
        self.canon.member_end(self.key);
        Ok(value)
    }
}

impl<'de, A: MapAccess<'de>> VariantAccess<'de> for ObjectVariant<'_, '_, A> {
    type Error = A::Error;

    fn unit_variant(self) -> Result<(), A::Error> {
        self.value(PhantomData::<()>)
    }
    fn newtype_variant_seed<S: DeserializeSeed<'de>>(self, seed: S) -> Result<S::Value, A::Error> {
        self.value(seed)
    }
    fn tuple_variant<V: Visitor<'de>>(self, _: usize, visitor: V) -> Result<V::Value, A::Error> {
        self.value(TupleVariant(visitor))
    }
    fn struct_variant<V: Visitor<'de>>(
        self,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, A::Error> {
        self.value(StructVariant(fields, visitor))
    }
}

/// A tuple variant's value: serde_json reads it with `deserialize_seq`, whatever its length.
struct TupleVariant<V>(V);

impl<'de, V: Visitor<'de>> DeserializeSeed<'de> for TupleVariant<V> {
    type Value = V::Value;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<V::Value, D::Error> {
        de.deserialize_seq(self.0)
    }
}

/// A struct variant's value: serde_json reads it with `deserialize_struct` of an empty name.
struct StructVariant<V>(&'static [&'static str], V);

impl<'de, V: Visitor<'de>> DeserializeSeed<'de> for StructVariant<V> {
    type Value = V::Value;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<V::Value, D::Error> {
        de.deserialize_struct("", self.0, self.1)
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{any_doc, reference, JSON};
    use super::*;
    use serde::Deserialize;
    use std::collections::{BTreeMap, HashMap};

    /// What the one parse makes of `body` as a `T`, checked against the two it replaces: `T` is
    /// serde_json's, or the parse refused (and the caller will run serde_json itself); a sure
    /// fingerprint is the reference's. Returns whether the parse deserialized and was sure.
    fn check<T>(body: &str) -> Outcome
    where
        T: DeserializeOwned + PartialEq + fmt::Debug,
    {
        let expected = serde_json::from_slice::<T>(body.as_bytes()).ok();
        let Some((value, fingerprint)) = parse::<T>("POST", "/p", body.as_bytes()) else {
            return match expected {
                None => Outcome::Refused,
                Some(_) => Outcome::Declined,
            };
        };
        assert_eq!(
            Some(&value),
            expected.as_ref(),
            "T as serde_json makes it: {body}"
        );
        let Some(fingerprint) = fingerprint else {
            return Outcome::Unsure;
        };
        assert_eq!(
            fingerprint,
            reference("POST", "/p", body.as_bytes()),
            "the fingerprint: {body}"
        );
        assert_eq!(
            fingerprint,
            Fingerprint::of_request("POST", "/p", JSON, body.as_bytes())
        );
        Outcome::Sure
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Outcome {
        /// `T` and the fingerprint from one parse.
        Sure,
        /// `T` from one parse; the fingerprint from a second.
        Unsure,
        /// No `T` in the body, for serde_json either: the caller's extractor rejects it.
        Refused,
        /// A `T` for serde_json, but in a way the one parse does not reproduce: the caller's
        /// extractor parses it.
        Declined,
    }
    use Outcome::{Declined, Refused, Sure, Unsure};

    #[derive(Debug, PartialEq, Deserialize)]
    struct Payment {
        amount: i64,
        currency: String,
        description: Option<String>,
        #[serde(default)]
        tags: Vec<String>,
    }

    #[derive(Debug, PartialEq, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Strict {
        a: u32,
        b: bool,
    }

    #[derive(Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize)]
    enum Currency {
        #[serde(rename = "KRW")]
        Won,
        #[serde(rename = "USD", alias = "usd")]
        Dollar,
    }

    #[derive(Debug, PartialEq, Deserialize)]
    enum Command {
        Stop,
        Move(i32),
        Jump(i32, i32),
        Say { text: String, loud: bool },
    }

    #[derive(Debug, PartialEq, Deserialize)]
    #[serde(tag = "type", rename_all = "snake_case")]
    enum Tagged {
        Card { last4: String },
        Bank { iban: String, bic: Option<String> },
    }

    #[derive(Debug, PartialEq, Deserialize)]
    #[serde(tag = "t", content = "c")]
    enum Adjacent {
        A(u8),
        B { x: f64 },
    }

    #[derive(Debug, PartialEq, Deserialize)]
    #[serde(untagged)]
    enum Untagged {
        Number(f64),
        Pair(String, i64),
        Thing { name: String },
    }

    #[derive(Debug, PartialEq, Deserialize)]
    struct Flattened {
        id: u64,
        #[serde(flatten)]
        rest: HashMap<String, serde_json::Value>,
    }

    #[derive(Debug, PartialEq, Deserialize)]
    struct Wrapped(Payment);

    #[derive(Debug, PartialEq, Deserialize)]
    struct Point(i32, i32);

    #[derive(Debug, PartialEq, Deserialize)]
    struct Unit;

    #[derive(Debug, PartialEq, Deserialize)]
    struct Order {
        currency: Currency,
        commands: Vec<Command>,
        method: Tagged,
        note: Option<Option<String>>,
        at: std::net::IpAddr,
        letter: char,
        small: u8,
        ratio: f64,
        name: Box<str>,
    }

    #[test]
    fn a_struct_deserializes_and_fingerprints_in_one_parse() {
        for body in [
            r#"{"amount": 1000, "currency": "KRW", "description": "two apples"}"#,
            r#"{"currency":"KRW","amount":1000,"description":null}"#,
            r#" { "description" : "\u00e9t\u00e9 \"quoted\"\n" , "amount" : -5, "currency" : "K\u0052W" } "#,
            // Fields the type does not know, of every shape, in and out of order.
            r#"{"zeta":{"b":[1,{"y":2,"x":1}],"a":null},"amount":1,"currency":"X","description":"d","alpha":[true,false,1.5e3]}"#,
            r#"{"amount":1,"currency":"X","description":"d","tags":["b","a"],"tags2":{"\u0061":1}}"#,
            // A repeated unknown key: the last one counts, as in `Value`.
            r#"{"amount":1,"x":1,"currency":"X","x":{"n":2},"description":null}"#,
            r#"{"amount":1,"currency":"X","description":null,"a\"b":1,"a ":2,"a":3}"#,
        ] {
            assert_eq!(check::<Payment>(body), Sure, "{body}");
        }
    }

    #[test]
    fn what_does_not_deserialize_is_left_to_the_extractor() {
        for body in [
            r#"{"amount":"1000","currency":"KRW"}"#, // a string where a number goes
            r#"{"amount":1000}"#,                    // a field missing
            r#"{"amount":1000,"currency":"KRW","amount":2}"#, // a field repeated
            r#"{"amount":1000,"currency":"KRW""#,    // cut short
            r#"{"amount":1000,"currency":"KRW"} {}"#, // trailing data
            "",
            "[]",
        ] {
            assert_eq!(check::<Payment>(body), Refused, "{body}");
        }
        assert_eq!(check::<Strict>(r#"{"a":1,"b":true,"c":0}"#), Refused);
        assert_eq!(check::<Strict>(r#"{"b":true,"a":1}"#), Sure);
        // Skipped by serde_json, parsed here: a number beyond f64 in an ignored field deserializes
        // for serde_json but not through the one parse, which then leaves it to the extractor.
        assert_eq!(
            check::<Payment>(r#"{"amount":1,"currency":"X","description":null,"x":1e400}"#),
            Declined
        );
    }

    #[test]
    fn enums_deserialize_as_serde_json_reads_both_of_their_forms() {
        for body in [
            r#""KRW""#,
            r#""USD""#,
            r#""usd""#,
            r#""\u004bRW""#, // escaped
        ] {
            assert_eq!(check::<Currency>(body), Sure, "{body}");
        }
        for (body, outcome) in [
            (r#"{"KRW":null}"#, Sure), // the object form of a unit variant
            (r#""Won""#, Refused),     // renamed
            ("1", Refused),
            (r#"{"KRW":null,"USD":null}"#, Refused),
        ] {
            assert_eq!(check::<Currency>(body), outcome, "{body}");
        }
        for body in [
            r#""Stop""#,
            r#"{"Stop":null}"#,
            r#"{"Move":-3}"#,
            r#"{ "Jump" : [ 1 , 2 ] }"#,
            r#"{"Say":{"loud":true,"text":"hi"}}"#,
            r#"{"Say":{"text":"hi","loud":false,"extra":{"b":1,"a":2}}}"#,
        ] {
            assert_eq!(check::<Command>(body), Sure, "{body}");
        }
        for (body, outcome) in [
            (r#"{"Say":["hi",true]}"#, Sure), // serde_json reads a struct variant from an array too
            (r#""Move""#, Refused),           // a newtype variant needs its value
            (r#"{"Move":1,"Stop":null}"#, Refused), // one member only
            (r#"{}"#, Refused),               // no variant
            (r#"{"Fly":1}"#, Refused),        // no such variant
            (r#"["Stop"]"#, Refused),
        ] {
            assert_eq!(check::<Command>(body), outcome, "{body}");
        }
        assert_eq!(check::<Vec<Command>>(r#"["Stop",{"Move":2},"Stop"]"#), Sure);
    }

    #[test]
    fn buffered_forms_deserialize_and_fingerprint_in_one_parse() {
        for body in [
            r#"{"type":"card","last4":"4242"}"#,
            r#"{"iban":"DE00","type":"bank","bic":null,"other":[1]}"#,
        ] {
            assert_eq!(check::<Tagged>(body), Sure, "{body}");
        }
        for body in [r#"{"t":"A","c":7}"#, r#"{"c":{"x":0.5},"t":"B"}"#] {
            assert_eq!(check::<Adjacent>(body), Sure, "{body}");
        }
        for body in [r#"2.5"#, r#"["a",-1]"#, r#"{"name":"n","z":0}"#] {
            assert_eq!(check::<Untagged>(body), Sure, "{body}");
        }
        assert_eq!(
            check::<Flattened>(r#"{"z":{"b":1,"a":2},"id":7,"a":[null]}"#),
            Sure
        );
    }

    #[test]
    fn containers_and_scalars_deserialize_and_fingerprint_in_one_parse() {
        assert_eq!(
            check::<Wrapped>(r#"{"currency":"KRW","amount":1,"description":null}"#),
            Sure
        );
        assert_eq!(check::<Point>("[1, -2]"), Sure);
        assert_eq!(check::<Unit>("null"), Sure);
        assert_eq!(check::<()>("null"), Sure);
        assert_eq!(check::<(i32, String, bool)>(r#"[1,"a",true]"#), Sure);
        assert_eq!(check::<[u8; 3]>("[1,2,3]"), Sure);
        assert_eq!(check::<Vec<u8>>("[1,2,255]"), Sure);
        assert_eq!(check::<Option<u64>>("null"), Sure);
        assert_eq!(check::<Option<u64>>("18446744073709551615"), Sure);
        assert_eq!(check::<i64>("-9223372036854775808"), Sure);
        assert_eq!(check::<f64>("1e-7"), Sure);
        assert_eq!(check::<f64>("0.30000000000000004441"), Sure);
        assert_eq!(check::<String>(r#""a\ud83d\ude00b""#), Sure);
        assert_eq!(
            check::<HashMap<String, i64>>(r#"{"b":1,"a":2,"b":3}"#),
            Sure
        );
        assert_eq!(
            check::<BTreeMap<String, serde_json::Value>>(r#"{"b":[{"y":1,"x":2}],"a":{}}"#),
            Sure
        );
        assert_eq!(check::<HashMap<Currency, u64>>(r#"{"KRW":1}"#), Unsure);
        assert_eq!(
            check::<Order>(
                r#"{"note":{"x":1}, "currency":"USD","commands":["Stop",{"Jump":[3,4]}],
                "method":{"type":"card","last4":"1"},"at":"::1","letter":"é","small":255,
                "ratio":1.0,"name":"n"}"#
            ),
            Refused // `note` is no string
        );
        assert_eq!(
            check::<Order>(
                r#"{"note":"x", "currency":"USD","commands":["Stop",{"Jump":[3,4]}],
                "method":{"type":"card","last4":"1"},"at":"::1","letter":"é","small":255,
                "ratio":1.0,"name":"n","extra":[{"b":2,"a":1}]}"#
            ),
            Sure
        );
    }

    #[test]
    fn values_in_shapes_the_canonical_form_never_sees_leave_the_fingerprint_to_a_second_parse() {
        // Parsed at single precision: the f64 the canonical form writes is not this one.
        assert_eq!(check::<f32>("0.1"), Unsure);
        assert_eq!(
            check::<i128>("170141183460469231731687303715884105727"),
            Unsure
        );
        assert_eq!(check::<u128>("1"), Unsure);
        // Keys read as numbers or booleans: their text is not kept.
        assert_eq!(
            check::<HashMap<u32, String>>(r#"{"2":"b","1":"a"}"#),
            Unsure
        );
        assert_eq!(check::<BTreeMap<i64, u8>>(r#"{"-1":1,"7":2}"#), Unsure);
        assert_eq!(check::<HashMap<bool, u8>>(r#"{"true":1}"#), Unsure);
        // serde_json's `RawValue` reads the text as written.
        #[derive(Debug, Deserialize)]
        struct Raw {
            a: Box<serde_json::value::RawValue>,
        }
        impl PartialEq for Raw {
            fn eq(&self, other: &Raw) -> bool {
                self.a.get() == other.a.get()
            }
        }
        assert_eq!(check::<Raw>(r#"{"a": {"y":1, "x":2}}"#), Unsure);
        // A `Deserialize` that never reads the body: `Write` calls an empty body no JSON.
        #[derive(Debug, PartialEq)]
        struct Ignores;
        impl<'de> Deserialize<'de> for Ignores {
            fn deserialize<D: Deserializer<'de>>(_: D) -> Result<Self, D::Error> {
                Ok(Ignores)
            }
        }
        assert_eq!(check::<Ignores>(""), Unsure);
        assert_eq!(check::<Ignores>("  "), Unsure);
        // The fingerprint then comes from a second parse, and is the reference's.
        let (_, fingerprint) =
            of_json_request::<f32>("POST", "/p", JSON, b"0.1").expect("deserializes");
        assert_eq!(fingerprint, reference("POST", "/p", b"0.1"));
        let (_, fingerprint) = of_json_request::<Ignores>("POST", "/p", JSON, b"").expect("Ok");
        assert_eq!(fingerprint, reference("POST", "/p", b""));
    }

    #[test]
    fn a_media_type_the_fingerprint_compares_as_bytes_is_fingerprinted_as_bytes() {
        // axum's `Json` accepts no such type, but the one parse must agree with `of_request`
        // whatever it is handed.
        let body = br#"{"b":1,"a":2}"#;
        let (value, fingerprint) =
            of_json_request::<HashMap<String, u8>>("POST", "/p", Some("text/plain"), body)
                .expect("deserializes");
        assert_eq!(value.len(), 2);
        assert_eq!(
            fingerprint,
            Fingerprint::of_request("POST", "/p", Some("text/plain"), body)
        );
        assert_ne!(fingerprint, reference("POST", "/p", body));
    }

    /// A field that keeps what deserializes and swallows the error otherwise: serde_json has then
    /// consumed a value the canonical form never got.
    fn lenient<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
        de: D,
    ) -> Result<Option<T>, D::Error> {
        Ok(T::deserialize(de).ok())
    }

    #[derive(Debug, PartialEq, Deserialize)]
    #[serde(bound(deserialize = "T: Deserialize<'de>"))]
    struct Lenient<T> {
        #[serde(deserialize_with = "lenient", default)]
        a: Option<T>,
        b: u8,
    }

    #[derive(Debug, PartialEq, Deserialize)]
    struct Point2 {
        x: u32,
        y: u32,
    }

    #[test]
    fn an_error_that_deserialize_swallows_leaves_the_body_to_the_extractor() {
        // serde_json consumes the mismatched scalar and goes on; the form never got it. Both bodies
        // would otherwise have written `{"a":,"b":1}` and shared a fingerprint.
        assert_eq!(check::<Lenient<u32>>(r#"{"a":"abc","b":1}"#), Declined);
        assert_eq!(check::<Lenient<u32>>(r#"{"a":true,"b":1}"#), Declined);
        assert_eq!(check::<Lenient<u32>>(r#"{"a":7,"b":1}"#), Sure);
        // Inside an object left half-read (a field missing): its members were written, its end
        // never was. Out of order and in order.
        assert_eq!(check::<Lenient<Point2>>(r#"{"a":{"x":1},"b":1}"#), Declined);
        assert_eq!(check::<Lenient<Point2>>(r#"{"b":1,"a":{"x":1}}"#), Declined);
        assert_eq!(
            check::<Lenient<Point2>>(r#"{"b":1,"a":{"y":2,"x":1}}"#),
            Sure
        );
        // Inside an array, and inside an enum's value.
        let outcome = check::<Lenient<(u8, u8)>>(r#"{"b":1,"a":[300,1]}"#);
        assert!(matches!(outcome, Declined | Refused), "{outcome:?}");
        let outcome = check::<Lenient<Command>>(r#"{"a":{"Move":"far"},"b":1}"#);
        assert!(matches!(outcome, Declined | Refused), "{outcome:?}");
        // serde_json reads an enum only from a string or an object, and consumes nothing else:
        // the one parse, which reads the value whatever it is, refuses what serde_json does.
        assert_eq!(check::<Lenient<Currency>>(r#"{"a":null,"b":1}"#), Refused);
        assert_eq!(check::<Lenient<Currency>>(r#"{"a":5,"b":1}"#), Refused);
        assert_eq!(check::<Lenient<Currency>>(r#"{"a":"KRW","b":1}"#), Sure);
    }

    #[test]
    fn a_panic_caught_inside_deserialize_leaves_the_body_to_the_extractor() {
        use std::panic::{catch_unwind, AssertUnwindSafe};
        /// Panics on 1.
        struct NotOne(u64);
        impl<'de> Deserialize<'de> for NotOne {
            fn deserialize<D: Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
                match u64::deserialize(de)? {
                    1 => panic!("a panic caught by the type that raised it (test)"),
                    n => Ok(NotOne(n)),
                }
            }
        }
        /// Catches the panics of its elements' and values' `Deserialize`, keeping a `None`.
        #[derive(Debug, PartialEq)]
        struct Catching(Vec<(Option<String>, Option<u64>)>);
        impl<'de> Deserialize<'de> for Catching {
            fn deserialize<D: Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
                struct Catch;
                impl<'de> Visitor<'de> for Catch {
                    type Value = Catching;
                    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                        f.write_str("an array or an object of numbers")
                    }
                    fn visit_seq<A: SeqAccess<'de>>(
                        self,
                        mut seq: A,
                    ) -> Result<Catching, A::Error> {
                        let mut out = Vec::new();
                        loop {
                            match catch_unwind(AssertUnwindSafe(|| seq.next_element::<NotOne>())) {
                                Ok(Ok(Some(n))) => out.push((None, Some(n.0))),
                                Ok(Ok(None)) => return Ok(Catching(out)),
                                Ok(Err(e)) => return Err(e),
                                Err(_) => out.push((None, None)),
                            }
                        }
                    }
                    fn visit_map<A: MapAccess<'de>>(
                        self,
                        mut map: A,
                    ) -> Result<Catching, A::Error> {
                        let mut out = Vec::new();
                        while let Some(key) = map.next_key::<String>()? {
                            match catch_unwind(AssertUnwindSafe(|| map.next_value::<NotOne>())) {
                                Ok(Ok(n)) => out.push((Some(key), Some(n.0))),
                                Ok(Err(e)) => return Err(e),
                                Err(_) => out.push((Some(key), None)),
                            }
                        }
                        Ok(Catching(out))
                    }
                }
                de.deserialize_any(Catch)
            }
        }
        // The panic unwound past the comma's bookkeeping: `[1,2]` would have been written `[2]`,
        // and `{"b":1,"a":2}` as `{"b":1"a":2}`, each member unlisted.
        assert_eq!(check::<Catching>("[1,2]"), Declined);
        assert_eq!(check::<Catching>(r#"{"b":1,"a":2}"#), Declined);
        assert_eq!(check::<Catching>("[12]"), Sure);
        assert_eq!(check::<Catching>(r#"{"b":3,"a":2}"#), Sure);
    }

    #[test]
    fn an_enum_visitor_that_does_not_read_its_variant_is_refused() {
        /// Accepts any enum without reading it.
        #[derive(Debug, PartialEq)]
        struct Unread;
        impl<'de> Deserialize<'de> for Unread {
            fn deserialize<D: Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
                struct AnyEnum;
                impl<'de> Visitor<'de> for AnyEnum {
                    type Value = Unread;
                    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                        f.write_str("an enum")
                    }
                    fn visit_enum<A: EnumAccess<'de>>(self, _: A) -> Result<Unread, A::Error> {
                        Ok(Unread)
                    }
                }
                de.deserialize_enum("Unread", &["A"], AnyEnum)
            }
        }
        // serde_json consumed nothing of it, and finds it trailing.
        assert_eq!(check::<Unread>(r#""A""#), Refused);
        assert_eq!(check::<Unread>(r#"{"A":1}"#), Refused);
    }

    #[test]
    fn deep_nesting_is_bounded_as_serde_json_bounds_it() {
        // serde_json refuses past 128 levels; the one parse refuses with it, and below it agrees.
        for depth in [1, 64, 126, 127, 128, 129, 300] {
            let body = format!("{}1{}", r#"{"z":["#.repeat(depth), "]}".repeat(depth));
            let outcome = check::<serde_json::Value>(&body);
            let parses = serde_json::from_str::<serde_json::Value>(&body).is_ok();
            assert_eq!(outcome == Sure, parses, "depth {depth}: {outcome:?}");
        }
    }

    #[test]
    fn the_thread_buffer_is_shared_with_fingerprints_taken_inside_a_deserialize() {
        /// Fingerprints something while it is being deserialized.
        #[derive(Debug, PartialEq)]
        struct Reentrant(String, Fingerprint);
        impl<'de> Deserialize<'de> for Reentrant {
            fn deserialize<D: Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
                let text = String::deserialize(de)?;
                let inner = Fingerprint::of_request("POST", "/q", JSON, br#"{"b":1,"a":2}"#);
                Ok(Reentrant(text, inner))
            }
        }
        assert_eq!(check::<Reentrant>(r#""x""#), Sure);
        let (value, _) = parse::<Reentrant>("POST", "/p", br#""x""#).expect("deserializes");
        assert_eq!(value.1, reference("POST", "/q", br#"{"a":2,"b":1}"#));
    }

    proptest::proptest! {
        /// Any document, as an untyped `Value`: one parse, the reference's fingerprint.
        #[test]
        fn any_document_as_a_value_fingerprints_as_the_reference_does(doc in any_doc()) {
            for spaced in [false, true] {
                let mut body = String::new();
                doc.write(spaced, &mut body);
                proptest::prop_assert_eq!(check::<serde_json::Value>(&body), Sure, "{}", body);
            }
        }

        /// A payment with its members in any order, among unknown members of any shape.
        #[test]
        fn a_typed_body_among_any_members_fingerprints_as_the_reference_does(
            amount in proptest::num::i64::ANY,
            currency in "[A-Z\"\\\\\u{e9}]{0,4}",
            description in proptest::option::of("[a-z\n]{0,8}"),
            extra in proptest::collection::vec(("[a-z]{1,3}", any_doc()), 0..4),
            order in proptest::collection::vec(0usize..8, 8),
            spaced in proptest::bool::ANY,
        ) {
            let text = |v: &serde_json::Value| serde_json::to_string(v).expect("serialises");
            let mut members = vec![
                format!(r#""amount":{amount}"#),
                format!(r#""currency":{}"#, text(&currency.clone().into())),
                format!(r#""description":{}"#, text(&description.clone().into())),
            ];
            for (key, value) in &extra {
                if ["amount", "currency", "description", "tags"].contains(&key.as_str()) {
                    continue;
                }
                let mut written = String::new();
                value.write(spaced, &mut written);
                members.push(format!("{}:{written}", text(&key.clone().into())));
            }
            for (i, j) in order.iter().enumerate() {
                let (i, j) = (i % members.len(), j % members.len());
                members.swap(i, j);
            }
            let gap = if spaced { " \n" } else { "" };
            let body = format!("{{{gap}{}{gap}}}", members.join(&format!(",{gap}")));
            let outcome = check::<Payment>(&body);
            // A key repeated among the extra members makes `Payment` reject the body (when it is
            // one of its fields) or not; either way nothing else may happen.
            proptest::prop_assert!(outcome == Sure || outcome == Refused, "{}: {:?}", body, outcome);
            if extra.iter().all(|(key, _)| key != "amount" && key != "currency" && key != "description" && key != "tags") {
                proptest::prop_assert_eq!(outcome, Sure, "{}", body);
            }
        }
    }
}
