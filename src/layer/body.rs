//! The body of every response the layer returns: the inner service's own, or one the layer
//! wrote itself (a rejection, a failure).

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

pin_project! {
    /// The response body of [`RateLimit`](super::RateLimit): the inner service's body when the
    /// request went through, or the layer's own answer (a 429's text or problem details, a
    /// failure's text, nothing for gRPC) when it did not.
    ///
    /// A wrapper rather than a bound on the inner body, so that the layer works over any
    /// [`http_body::Body`] whose data is [`Bytes`]: axum's, hyper's, tonic's, a `String`. It is
    /// a [`Body`] whenever the inner one is, with the same error type; axum, hyper and tonic
    /// serve it as they are.
    ///
    /// To read a response in a test, collect it (`http_body_util::BodyExt::collect`), or take
    /// the inner body back with [`into_inner`](Self::into_inner).
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner {
            #[pin]
            body: B,
        },
        // Taken by the first poll; `None` once sent.
        Answer {
            data: Option<Bytes>,
        },
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn inner(body: B) -> Self {
        Self {
            kind: Kind::Inner { body },
        }
    }

    pub(crate) fn answer(data: Bytes) -> Self {
        Self {
            kind: Kind::Answer {
                data: (!data.is_empty()).then_some(data),
            },
        }
    }

    /// The inner service's body, or the layer's own answer when the layer answered.
    ///
    /// # Errors
    ///
    /// The layer's answer, as bytes, when the request never reached the inner service.
    pub fn into_inner(self) -> Result<B, Bytes> {
        match self.kind {
            Kind::Inner { body } => Ok(body),
            Kind::Answer { data } => Err(data.unwrap_or_default()),
        }
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.project().kind.project() {
            KindProj::Inner { body } => body.poll_frame(cx),
            KindProj::Answer { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Answer { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body } => body.size_hint(),
            Kind::Answer { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
        }
    }
}

impl<B: fmt::Debug> fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Kind::Inner { body } => f.debug_tuple("ResponseBody::Inner").field(body).finish(),
            Kind::Answer { data } => f
                .debug_struct("ResponseBody::Answer")
                .field("len", &data.as_ref().map_or(0, Bytes::len))
                .finish(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn an_answer_is_one_frame_of_its_exact_size() {
        let body = ResponseBody::<String>::answer(Bytes::from_static(b"rate limited\n"));
        assert_eq!(body.size_hint().exact(), Some(13));
        assert!(!body.is_end_stream());
        let bytes = body.collect().await.unwrap().to_bytes();
        assert_eq!(&bytes[..], b"rate limited\n");
    }

    #[tokio::test]
    async fn an_empty_answer_ends_at_once() {
        // A gRPC refusal: its status is in the headers, and hyper ends the stream with them
        // (a trailers-only response) only when the body says it is over before the first poll.
        let body = ResponseBody::<String>::answer(Bytes::new());
        assert!(body.is_end_stream());
        assert_eq!(body.size_hint().exact(), Some(0));
        assert!(body.collect().await.unwrap().to_bytes().is_empty());
    }

    #[tokio::test]
    async fn the_inner_body_passes_through() {
        let body = ResponseBody::inner(String::from("hello"));
        assert_eq!(body.size_hint().exact(), Some(5));
        let bytes = body.collect().await.unwrap().to_bytes();
        assert_eq!(&bytes[..], b"hello");
        assert_eq!(
            ResponseBody::inner(String::from("x")).into_inner(),
            Ok(String::from("x"))
        );
        assert_eq!(
            ResponseBody::<String>::answer(Bytes::from_static(b"no")).into_inner(),
            Err(Bytes::from_static(b"no"))
        );
    }
}
