//! Serde for the types kept as text (feature `serde`): each serializes as its `Display` and
//! deserializes through its `FromStr`, so a configuration file or a job's payload holds the
//! same line a log or a human would.

/// `Serialize` and `Deserialize` for `$ty` through its `Display` and `FromStr`; `$what` says
/// what a deserializer expected, as in "a limit such as \"10/s burst 20\"".
macro_rules! serde_as_text {
    ($ty:ty, $what:literal) => {
        #[cfg(feature = "serde")]
        #[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
        impl serde::Serialize for $ty {
            /// The text form, as `Display` writes it.
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.collect_str(self)
            }
        }

        #[cfg(feature = "serde")]
        #[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
        impl<'de> serde::Deserialize<'de> for $ty {
            /// The text form, as `FromStr` reads it; a text it refuses is an error with its
            /// message.
            fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                struct Text;

                impl serde::de::Visitor<'_> for Text {
                    type Value = $ty;

                    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                        f.write_str($what)
                    }

                    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<$ty, E> {
                        v.parse().map_err(E::custom)
                    }
                }

                deserializer.deserialize_str(Text)
            }
        }
    };
}

pub(crate) use serde_as_text;
